"""A DCP `.metadata` read in C, into flat arrays: no Python object per record (issue 40).

The inert unpickler (`pickle_reader`) builds five placeholder records per item of a DCP `.metadata` (the item's
`TensorStorageMetadata`, its `TensorProperties`, a `ChunkStorageMetadata`, `torch.Size`s, its `MetadataIndex` and
`_StorageInfo`): ~8-9 us per item in the C unpickler alone, most of what opening a 10^5-10^6-item checkpoint costs.
Here the opcode stream is interpreted once in C into a graph of plain C nodes (no code is run, no pickled global is
looked up or built: a global is its two names), then the exact layout torch's `dcp.save` writes is read out of that
graph as one array of int64s: per `state_dict_metadata` entry its key, kind, dtype global, size and chunks (offsets,
sizes); per `storage_data` entry its fqn, chunk offset, file, offset and length; `planner_data`; `version`; and every
global the stream names. Strings are (offset, length) into the pickle's bytes.

Anything else — an opcode outside the few `pickle.dump` of a `Metadata` uses, a record class or field layout that is
not exactly DCP's, a duplicate key, a mark or stack underflow, a memo key far out of range, a bound below reached —
answers "ask Python": `read()` returns None and the inert unpickler reads the file as before,
with its own checks and messages. So the answer is the Python path's, or the same answer reached without it
(tests/test_native_dcp.py compares both on every DCP / torch_dist sample and on hostile inputs). The pickle safety
walk (`pickle_reader.check_expansion`: hash bombs, nesting) runs first either way; the C reader also bounds its own
memory: nodes and output ints at most one per two bytes of the pickle, string output at most two bytes per byte,
memo keys below the file's size (about 18 bytes per byte of the pickle at most, however its records share one
another).

Compiled on first use with the system C compiler, cached and loaded as `native_walk` does; optional (CKPT_NATIVE=0,
or no compiler: the Python path answers).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from itertools import islice

from . import allowlist, native_walk, pickle_reader


SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { K_STR = 1, K_INT, K_NONE, K_BOOL, K_GLOBAL, K_TUPLE, K_LIST, K_DICT, K_OBJ, K_SIZE };
/* what a global names: the records of torch.distributed.checkpoint's Metadata, torch.Size, another torch.* */
enum { G_OTHER, G_METADATA, G_TSM, G_BSM, G_PROPS, G_CHUNK, G_INDEX, G_INFO, G_SIZE, G_TORCH };
#define F_NEWOBJ 1
#define F_REDUCE 2

typedef struct { int64_t a; int32_t b, n, st; int8_t kind, made; } node_t;  /* made: 1 NEWOBJ, 2 REDUCE */
typedef struct { int32_t k, v, next; } edge_t;
typedef struct { int64_t mo, ml, no, nl; int32_t code, flags; } glob_t;

typedef struct {
    const unsigned char *d; int64_t end;
    node_t *nodes; int64_t nn, ncap;
    edge_t *edges; int64_t ne, ecap;
    int32_t *kids; int64_t nk, kcap;
    int32_t *stack; int64_t sp, scap;
    int64_t *marks; int64_t nm, mcap;
    int32_t *memo; int64_t memocap, memocount;
    glob_t *globs; int64_t ng, gcap;
    int64_t *out; int64_t no, ocap, olimit;
    char *sb; int64_t sn, scap2, slimit;
    int64_t nmax, k_none, k_true, k_false, k_empty;  /* the most nodes; the shared None, True, False and () */
} R;

#define GROW(ptr, n, cap, init) do { if ((n) >= (cap)) { int64_t c_ = (cap) ? (cap) * 2 : (init); \
    void *p_ = realloc((ptr), (size_t)c_ * sizeof *(ptr)); if (!p_) return -1; (ptr) = p_; (cap) = c_; } } while (0)

static int64_t new_node(R *r, int kind, int64_t a, int64_t b) {
    if (r->nn >= r->nmax) return -1;
    GROW(r->nodes, r->nn, r->ncap, 4096);
    node_t *x = &r->nodes[r->nn];
    if (b < 0 || b > INT32_MAX) return -1;
    x->kind = (int8_t)kind; x->made = 0; x->st = -1; x->a = a; x->b = (int32_t)b; x->n = 0;
    return r->nn++;
}
static int push(R *r, int64_t v) {
    if (v < 0) return -1;
    GROW(r->stack, r->sp, r->scap, 1024);
    r->stack[r->sp++] = (int32_t)v;
    return 0;
}
static int64_t base(R *r) { return r->nm ? r->marks[r->nm - 1] : 0; }
static int64_t pop(R *r) { return r->sp > base(r) ? r->stack[--r->sp] : -1; }
static int add_edge(R *r, int64_t c, int64_t k, int64_t v) {  /* append to a list (k = -1) or a dict */
    GROW(r->edges, r->ne, r->ecap, 4096);
    edge_t *e = &r->edges[r->ne];
    e->k = (int32_t)k; e->v = (int32_t)v; e->next = -1;
    node_t *x = &r->nodes[c];
    if (x->n) r->edges[x->b].next = (int32_t)r->ne; else x->a = r->ne;
    x->b = r->ne++; x->n++;
    return 0;
}
static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static int streq(R *r, int64_t n, const char *s) {
    const node_t *x = &r->nodes[n];
    size_t l = strlen(s);
    return x->kind == K_STR && (size_t)x->b == l && memcmp(r->d + x->a, s, l) == 0;
}
static int memo_put(R *r, int64_t key, int64_t v) {
    if (v < 0 || key < 0 || key > r->end + 16) return -1;
    if (key >= r->memocap) {
        int64_t c = r->memocap ? r->memocap : 4096;
        while (c <= key) c *= 2;
        int32_t *m = realloc(r->memo, (size_t)c * sizeof *m);
        if (!m) return -1;
        for (int64_t i = r->memocap; i < c; i++) m[i] = -1;
        r->memo = m; r->memocap = c;
    }
    if (r->memo[key] < 0) r->memocount++;
    r->memo[key] = (int32_t)v;
    return 0;
}
static int64_t memo_get(R *r, int64_t key) { return key >= 0 && key < r->memocap ? r->memo[key] : -1; }

static const char *MOD = "torch.distributed.checkpoint.metadata";
static int64_t glob(R *r, int64_t mod, int64_t name) {
    if (r->nodes[mod].kind != K_STR || r->nodes[name].kind != K_STR) return -1;
    const node_t *m = &r->nodes[mod], *n = &r->nodes[name];
    for (int64_t g = 0; g < r->ng; g++) {
        glob_t *x = &r->globs[g];
        if (x->ml == m->b && x->nl == n->b && !memcmp(r->d + x->mo, r->d + m->a, (size_t)m->b)
            && !memcmp(r->d + x->no, r->d + n->a, (size_t)n->b)) return new_node(r, K_GLOBAL, g, 0);
    }
    if (r->ng >= 4096) return -1;
    GROW(r->globs, r->ng, r->gcap, 64);
    glob_t *x = &r->globs[r->ng];
    x->mo = m->a; x->ml = m->b; x->no = n->a; x->nl = n->b; x->flags = 0; x->code = G_OTHER;
    if (streq(r, mod, MOD)) {
        x->code = streq(r, name, "Metadata") ? G_METADATA : streq(r, name, "TensorStorageMetadata") ? G_TSM
            : streq(r, name, "BytesStorageMetadata") ? G_BSM : streq(r, name, "TensorProperties") ? G_PROPS
            : streq(r, name, "ChunkStorageMetadata") ? G_CHUNK : streq(r, name, "MetadataIndex") ? G_INDEX : G_OTHER;
    } else if (streq(r, mod, "torch.distributed.checkpoint.filesystem") && streq(r, name, "_StorageInfo")) {
        x->code = G_INFO;
    } else if (streq(r, mod, "torch")) x->code = streq(r, name, "Size") ? G_SIZE : G_TORCH;
    return new_node(r, K_GLOBAL, r->ng++, 0);
}

/* the opcode stream -> the root node, or -1 (ask Python) */
static int64_t interpret(R *r) {
    const unsigned char *d = r->d;
    int64_t i = 0, end = r->end;
#define NEED(k) do { if (i + (k) > end) return -1; } while (0)
    while (i < end) {
        unsigned op = d[i++];
        int64_t x, y, z;
        switch (op) {
        case 0x80: NEED(1); i += 1; break;  /* PROTO */
        case 0x95: NEED(8); i += 8; break;  /* FRAME */
        case 0x8c: case 'X':  /* SHORT_BINUNICODE, BINUNICODE */
            y = op == 'X' ? 4 : 1;
            NEED(y);
            x = op == 'X' ? rd32(d + i) : d[i];
            NEED(y + x);
            if (push(r, new_node(r, K_STR, i + y, x))) return -1;
            i += y + x;
            break;
        case 0x94: if (r->sp <= 0 || memo_put(r, r->memocount, r->stack[r->sp - 1])) return -1; break;  /* MEMOIZE */
        case 'q': NEED(1); if (r->sp <= 0 || memo_put(r, d[i], r->stack[r->sp - 1])) return -1; i += 1; break;
        case 'r': NEED(4); if (r->sp <= 0 || memo_put(r, rd32(d + i), r->stack[r->sp - 1])) return -1; i += 4; break;
        case 'h': NEED(1); if (push(r, memo_get(r, d[i]))) return -1; i += 1; break;
        case 'j': NEED(4); if (push(r, memo_get(r, rd32(d + i)))) return -1; i += 4; break;
        case 0x93: y = pop(r); x = pop(r); if (x < 0 || y < 0 || push(r, glob(r, x, y))) return -1; break;
        case ')': if (push(r, r->k_empty)) return -1; break;
        case 0x85: case 0x86: case 0x87: case 't': {  /* TUPLE1-3, TUPLE */
            int64_t lo;
            if (op == 't') { if (!r->nm) return -1; lo = r->marks[--r->nm]; }
            else { lo = r->sp - (op - 0x84); if (lo < base(r)) return -1; }
            int64_t start = r->nk;
            for (int64_t q = lo; q < r->sp; q++) {
                GROW(r->kids, r->nk, r->kcap, 4096);
                r->kids[r->nk++] = r->stack[q];
            }
            x = new_node(r, K_TUPLE, start, 0);
            if (x < 0) return -1;
            r->nodes[x].n = r->sp - lo;
            r->sp = lo;
            if (push(r, x)) return -1;
            break;
        }
        case '(': GROW(r->marks, r->nm, r->mcap, 256); r->marks[r->nm++] = r->sp; break;
        case '}': if (push(r, new_node(r, K_DICT, 0, 0))) return -1; break;
        case ']': if (push(r, new_node(r, K_LIST, 0, 0))) return -1; break;
        case 'N': if (push(r, r->k_none)) return -1; break;
        case 0x88: case 0x89: if (push(r, op == 0x88 ? r->k_true : r->k_false)) return -1; break;
        case 'K': NEED(1); if (push(r, new_node(r, K_INT, d[i], 0))) return -1; i += 1; break;
        case 'M': NEED(2); if (push(r, new_node(r, K_INT, d[i] | d[i + 1] << 8, 0))) return -1; i += 2; break;
        case 'J': NEED(4); if (push(r, new_node(r, K_INT, (int32_t)rd32(d + i), 0))) return -1; i += 4; break;
        case 0x8a: {  /* LONG1: up to 8 bytes, two's complement */
            NEED(1); int64_t n = d[i]; NEED(1 + n);
            if (n > 8) return -1;
            uint64_t v = 0;
            for (int64_t q = n - 1; q >= 0; q--) v = v << 8 | d[i + 1 + q];
            if (n && n < 8 && (d[i + n] & 0x80)) v |= ~0ULL << (8 * n);
            if (push(r, new_node(r, K_INT, (int64_t)v, 0))) return -1;
            i += 1 + n;
            break;
        }
        case 0x81: case 'R': {  /* NEWOBJ, REDUCE: of a global, with a tuple of arguments */
            y = pop(r); x = pop(r);
            if (x < 0 || y < 0 || r->nodes[x].kind != K_GLOBAL || r->nodes[y].kind != K_TUPLE) return -1;
            glob_t *g = &r->globs[r->nodes[x].a];
            g->flags |= op == 'R' ? F_REDUCE : F_NEWOBJ;
            if (g->code == G_SIZE) {  /* torch.Size((ints...)): the inner tuple's items, ints only */
                if (op != 'R' || r->nodes[y].n != 1) return -1;
                z = r->kids[r->nodes[y].a];
                if (r->nodes[z].kind != K_TUPLE) return -1;
                for (int64_t q = 0; q < r->nodes[z].n; q++)
                    if (r->nodes[r->kids[r->nodes[z].a + q]].kind != K_INT) return -1;
                if (push(r, new_node(r, K_SIZE, z, 0))) return -1;
                break;
            }
            if (g->code == G_TORCH) return -1;  /* a dtype called, a storage class made: Python says what it is */
            z = new_node(r, K_OBJ, r->nodes[x].a, y);
            if (z < 0) return -1;
            r->nodes[z].made = op == 'R' ? 2 : 1;
            if (push(r, z)) return -1;
            break;
        }
        case 'b': {  /* BUILD: once, on a record; a dict or a tuple (not a (dict, slots) pair) */
            y = pop(r);
            if (y < 0 || r->sp <= base(r)) return -1;
            node_t *o = &r->nodes[r->stack[r->sp - 1]], *s = &r->nodes[y];
            if (o->kind != K_OBJ || o->st >= 0) return -1;
            if (!(s->kind == K_DICT || (s->kind == K_TUPLE && s->n != 2))) return -1;
            o->st = (int32_t)y;
            break;
        }
        case 's': case 'u': {  /* SETITEM, SETITEMS: on a dict */
            int64_t lo;
            if (op == 'u') { if (!r->nm) return -1; lo = r->marks[--r->nm]; }
            else lo = r->sp - 2;
            if (lo - 1 < base(r) || (r->sp - lo) % 2) return -1;
            x = r->stack[lo - 1];
            if (r->nodes[x].kind != K_DICT) return -1;
            for (int64_t q = lo; q < r->sp; q += 2) {
                int k = r->nodes[r->stack[q]].kind;
                if (k != K_STR && k != K_OBJ) return -1;  /* keys hashed by value (str) or identity (records) */
                if (add_edge(r, x, r->stack[q], r->stack[q + 1])) return -1;
            }
            r->sp = lo;
            break;
        }
        case 'a': case 'e': {  /* APPEND, APPENDS: on a list */
            int64_t lo;
            if (op == 'e') { if (!r->nm) return -1; lo = r->marks[--r->nm]; }
            else lo = r->sp - 1;
            if (lo - 1 < base(r)) return -1;
            x = r->stack[lo - 1];
            if (r->nodes[x].kind != K_LIST) return -1;
            for (int64_t q = lo; q < r->sp; q++) if (add_edge(r, x, -1, r->stack[q])) return -1;
            r->sp = lo;
            break;
        }
        case '.': return r->sp > base(r) && !r->nm ? r->stack[r->sp - 1] : -1;  /* STOP */
        default: return -1;  /* any other opcode: Python reads it */
        }
    }
    return -1;
}

static int emit(R *r, int64_t v) {
    if (r->no >= r->olimit) return -1;
    GROW(r->out, r->no, r->ocap, 65536);
    r->out[r->no++] = v;
    return 0;
}
#define E(v) do { if (emit(r, (v))) return -1; } while (0)

/* the value under `key` in the dict node `dn`, -1 when absent, -2 when a key repeats */
static int64_t field(R *r, int64_t dn, const char *key) {
    int64_t hit = -1;
    const node_t *x = &r->nodes[dn];
    for (int64_t e = x->n ? x->a : -1; e >= 0; e = r->edges[e].next)
        if (streq(r, r->edges[e].k, key)) { if (hit >= 0) return -2; hit = r->edges[e].v; }
    return hit;
}
/* a record of class `code`, made by NEWOBJ with no arguments; its state (-1: none) */
static int record(R *r, int64_t n, int code, int64_t *state) {
    const node_t *x = &r->nodes[n];
    if (x->kind != K_OBJ || x->made != 1 || r->globs[x->a].code != code || r->nodes[x->b].n) return 0;
    *state = x->st;
    return 1;
}
/* a dict state whose string keys are all distinct */
static int plain_state(R *r, int64_t s) {
    if (s < 0 || r->nodes[s].kind != K_DICT) return 0;
    for (int64_t e = r->nodes[s].n ? r->nodes[s].a : -1; e >= 0; e = r->edges[e].next) {
        const node_t *k = &r->nodes[r->edges[e].k];
        if (k->kind != K_STR) return 0;
        for (int64_t f = r->edges[e].next; f >= 0; f = r->edges[f].next) {
            const node_t *k2 = &r->nodes[r->edges[f].k];
            if (k2->b == k->b && !memcmp(r->d + k2->a, r->d + k->a, (size_t)k->b)) return 0;
        }
    }
    return 1;
}
static int emit_size(R *r, int64_t n) {  /* a torch.Size: its length, its ints */
    if (n < 0 || r->nodes[n].kind != K_SIZE) return -1;
    const node_t *t = &r->nodes[r->nodes[n].a];
    E(t->n);
    for (int64_t q = 0; q < t->n; q++) E(r->nodes[r->kids[t->a + q]].a);
    return 0;
}
/* a string: its bytes and a NUL into the string blob (none inside it: Python splits the blob at them) */
static int emit_span(R *r, int64_t a, int64_t b) {
    if (b && memchr(r->d + a, 0, (size_t)b)) return -1;
    if (r->sn + b + 1 > r->slimit) return -1;
    while (r->sn + b + 1 > r->scap2) {
        int64_t c = r->scap2 ? r->scap2 * 2 : 65536;
        char *p = realloc(r->sb, (size_t)c);
        if (!p) return -1;
        r->sb = p; r->scap2 = c;
    }
    memcpy(r->sb + r->sn, r->d + a, (size_t)b);
    r->sn += b;
    r->sb[r->sn++] = 0;
    return 0;
}
static int emit_str(R *r, int64_t n) {
    if (n < 0 || r->nodes[n].kind != K_STR) return -1;
    return emit_span(r, r->nodes[n].a, r->nodes[n].b);
}

/* the chunk record `c` is all of a tensor of torch.Size `size`: offsets all 0, sizes equal to `size` */
static int whole(R *r, int64_t size, int64_t c) {
    int64_t s, off, sz;
    if (size < 0 || r->nodes[size].kind != K_SIZE || !record(r, c, G_CHUNK, &s) || !plain_state(r, s)
        || r->nodes[s].n != 2) return 0;
    off = field(r, s, "offsets"); sz = field(r, s, "sizes");
    if (off < 0 || sz < 0 || r->nodes[off].kind != K_SIZE || r->nodes[sz].kind != K_SIZE) return 0;
    const node_t *t = &r->nodes[r->nodes[size].a], *o = &r->nodes[r->nodes[off].a], *z = &r->nodes[r->nodes[sz].a];
    if (o->n != t->n || z->n != t->n) return 0;
    for (int64_t q = 0; q < t->n; q++) {
        if (r->nodes[r->kids[o->a + q]].a != 0) return 0;
        if (r->nodes[r->kids[z->a + q]].a != r->nodes[r->kids[t->a + q]].a) return 0;
    }
    return 1;
}

static int64_t extract(R *r, int64_t root) {
    int64_t st, sdm, stor, plan, ver, s;
    if (!record(r, root, G_METADATA, &st) || !plain_state(r, st)) return -1;
    sdm = field(r, st, "state_dict_metadata"); stor = field(r, st, "storage_data");
    plan = field(r, st, "planner_data"); ver = field(r, st, "version");
    if (sdm < 0 || stor < 0 || r->nodes[sdm].kind != K_DICT || r->nodes[stor].kind != K_DICT) return -1;
    /* globals: module, name, what the stream did with each (NEWOBJ / REDUCE) */
    E(r->ng);
    for (int64_t g = 0; g < r->ng; g++) {
        glob_t *x = &r->globs[g];
        if (emit_span(r, x->mo, x->ml) || emit_span(r, x->no, x->nl)) return -1;
        E(x->flags);
    }
    /* version: 0 absent or None, else 1 and the string */
    if (ver == -1 || (ver >= 0 && r->nodes[ver].kind == K_NONE)) E(0);
    else { E(1); if (emit_str(r, ver)) return -1; }
    /* planner_data: -1 absent or None, else its entries: key, tuple of str / int items */
    if (plan == -1 || (plan >= 0 && r->nodes[plan].kind == K_NONE)) E(-1);
    else {
        if (plan < 0 || r->nodes[plan].kind != K_DICT) return -1;
        E(r->nodes[plan].n);
        for (int64_t e = r->nodes[plan].n ? r->nodes[plan].a : -1; e >= 0; e = r->edges[e].next) {
            const node_t *t = &r->nodes[r->edges[e].v];
            if (emit_str(r, r->edges[e].k) || t->kind != K_TUPLE) return -1;
            int all_str = 1;  /* then 1 and the strings, else 0 and each item: 1 and a string, 2 and an int */
            for (int64_t q = 0; q < t->n; q++) all_str &= r->nodes[r->kids[t->a + q]].kind == K_STR;
            E(t->n); E(all_str);
            for (int64_t q = 0; q < t->n && all_str; q++) if (emit_str(r, r->kids[t->a + q])) return -1;
            for (int64_t q = 0; q < t->n && !all_str; q++) {
                int64_t k = r->kids[t->a + q];
                if (r->nodes[k].kind == K_STR) { E(1); if (emit_str(r, k)) return -1; }
                else if (r->nodes[k].kind == K_INT) { E(2); E(r->nodes[k].a); }
                else return -1;
            }
        }
    }
    /* state_dict_metadata: key, kind (1 tensor: dtype global, size, chunks; 2 bytes) */
    E(r->nodes[sdm].n);
    for (int64_t e = r->nodes[sdm].n ? r->nodes[sdm].a : -1; e >= 0; e = r->edges[e].next) {
        int64_t v = r->edges[e].v;
        if (emit_str(r, r->edges[e].k)) return -1;
        if (record(r, v, G_BSM, &s)) { if (s >= 0) return -1; E(2); continue; }
        if (!record(r, v, G_TSM, &s) || !plain_state(r, s) || r->nodes[s].n != 3) return -1;
        int64_t props = field(r, s, "properties"), size = field(r, s, "size"), chunks = field(r, s, "chunks"), ps;
        if (props < 0 || size < 0 || chunks < 0 || !record(r, props, G_PROPS, &ps) || ps < 0) return -1;
        const node_t *pt = &r->nodes[ps];
        if (pt->kind != K_TUPLE || !pt->n) return -1;
        int64_t dt = r->kids[pt->a];
        if (r->nodes[dt].kind != K_GLOBAL || r->globs[r->nodes[dt].a].code != G_TORCH) return -1;
        if (r->nodes[chunks].kind != K_LIST) return -1;
        if (r->nodes[chunks].n == 1 && whole(r, size, r->edges[r->nodes[chunks].a].v)) {
            E(3); E(r->nodes[dt].a);  /* 3: one chunk, at offsets 0, of the tensor's size */
            if (emit_size(r, size)) return -1;
            continue;
        }
        E(1); E(r->nodes[dt].a);
        if (emit_size(r, size)) return -1;
        E(r->nodes[chunks].n);
        for (int64_t c = r->nodes[chunks].n ? r->nodes[chunks].a : -1; c >= 0; c = r->edges[c].next) {
            if (!record(r, r->edges[c].v, G_CHUNK, &s) || !plain_state(r, s) || r->nodes[s].n != 2) return -1;
            if (emit_size(r, field(r, s, "offsets")) || emit_size(r, field(r, s, "sizes"))) return -1;
        }
    }
    /* storage_data: fqn, chunk offset (-1: None), relative path, offset, length */
    E(r->nodes[stor].n);
    for (int64_t e = r->nodes[stor].n ? r->nodes[stor].a : -1; e >= 0; e = r->edges[e].next) {
        int64_t k = r->edges[e].k, v = r->edges[e].v, ks, vs, f;
        if (!record(r, k, G_INDEX, &ks) || !plain_state(r, ks) || r->nodes[k].made == 3) return -1;
        r->nodes[k].made = 3;  /* a key used twice: Python's dict (identity) keeps one entry; ask Python */
        if (!record(r, v, G_INFO, &vs) || !plain_state(r, vs)) return -1;
        if (emit_str(r, field(r, ks, "fqn"))) return -1;
        f = field(r, ks, "offset");
        if (f == -2) return -1;
        if (f == -1 || r->nodes[f].kind == K_NONE) E(-1); else if (emit_size(r, f)) return -1;
        f = field(r, vs, "transform_descriptors");
        if (f == -2 || (f >= 0 && r->nodes[f].kind != K_NONE)) return -1;
        if (emit_str(r, field(r, vs, "relative_path"))) return -1;
        int64_t off = field(r, vs, "offset"), len = field(r, vs, "length");
        if (off < 0 || len < 0 || r->nodes[off].kind != K_INT || r->nodes[len].kind != K_INT) return -1;
        E(r->nodes[off].a); E(r->nodes[len].a);
    }
    return r->no;
}

static void release(R *r) {
    free(r->nodes); free(r->edges); free(r->kids); free(r->stack); free(r->marks); free(r->memo); free(r->globs);
}

/* the ints (*n of them) and the string blob (*strs, *ns bytes), each freed by the caller with ckpt_dcp_free; or
   NULL: ask Python */
int64_t *ckpt_dcp_read(const unsigned char *d, int64_t end, int64_t *n, char **strs, int64_t *ns) {
    R r;
    memset(&r, 0, sizeof r);
    /* bounds, far above what dcp.save writes (~0.2 nodes, ~0.1 ints and ~0.5 string bytes per byte of .metadata):
       memory at most ~12 + 4 + 2 bytes per byte of the pickle, however its records share one another */
    r.d = d; r.end = end; r.nmax = end / 2 + 4096; r.olimit = end / 2 + 1024; r.slimit = 2 * end + 1024;
    r.k_none = new_node(&r, K_NONE, 0, 0);
    r.k_true = new_node(&r, K_BOOL, 1, 0);
    r.k_false = new_node(&r, K_BOOL, 0, 0);
    r.k_empty = new_node(&r, K_TUPLE, 0, 0);
    int64_t root = r.k_empty < 0 ? -1 : interpret(&r), got = -1;
    if (root >= 0) got = extract(&r, root);
    release(&r);
    if (got < 0 || !r.sb) { free(r.out); free(r.sb); return NULL; }
    *n = got; *strs = r.sb; *ns = r.sn;
    return r.out;
}

void ckpt_dcp_free(void *p) { free(p); }
"""


def _bind(dll):
    read, free = dll.ckpt_dcp_read, dll.ckpt_dcp_free
    read.restype = ctypes.POINTER(ctypes.c_int64)
    read.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_int64),
    ]
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    return read, free


def _functions():
    """(read, free) of the compiled reader (`native_walk.load`), or None."""
    return native_walk.load(SOURCE, "dcp", _bind)


def available() -> bool:
    """The C reader is built (or can be) and not switched off."""
    return _functions() is not None


def arrays(data: bytes) -> tuple[list[int], list[str]] | None:
    """The C reader's ints and strings for the pickle `data` (already delimited and walked), or None: ask Python
    (a string that is not UTF-8 raises UnicodeDecodeError, as the unpickler does)."""
    fns = _functions()
    if fns is None:
        return None
    read, free = fns
    n, strs, ns = ctypes.c_int64(0), ctypes.c_char_p(), ctypes.c_int64(0)
    ptr = read(data, len(data), ctypes.byref(n), ctypes.byref(strs), ctypes.byref(ns))
    if not ptr:
        return None
    try:
        ints = memoryview(ctypes.string_at(ptr, n.value * 8)).cast("q").tolist()
        text = ctypes.string_at(strs, ns.value)
    finally:
        free(ptr)
        free(strs)
    return ints, str(text, "utf-8", "surrogatepass").split("\0")[:-1]


@dataclass
class Metadata:
    """A DCP `.metadata` as the C reader gives it: what `formats.dcp.open` reads of the inert records.

    `state_dict_metadata`: key -> None (a bytes item) or (dtype name or None, size, [(offsets, sizes), ...]);
    `where`: (fqn, chunk offsets or None) -> (relative_path, offset, length), as `formats.dcp._storage_index` builds
    it from `storage_data` (a later entry for the same key wins); `files`: each relative_path, in the order
    `storage_data` first names it, -> the fqn of that entry; `planner_data`: key -> tuple of str / int; `version`:
    str or None; `globals_seen`: what the inert unpickler's `Loaded.globals_seen` holds for the same file."""

    state_dict_metadata: dict[str, tuple | None]
    where: dict[tuple, tuple]
    files: dict[str, str]
    planner_data: dict[str, tuple]
    version: str | None
    globals_seen: frozenset[str]


def read(path: str | os.PathLike) -> Metadata | None:
    """`.metadata` at `path` read by the C reader, or None: the inert unpickler must read it (no C reader here, a
    layout it does not take exactly, or a file the safety walk refuses: the unpickler's path says why)."""
    if _functions() is None:
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if data[:1] != b"\x80":
        return None
    try:
        end = pickle_reader.check_expansion(data, os.fspath(path))
    except Exception:  # noqa: BLE001  refused or unfollowable: the unpickler's path raises its own error
        return None
    if end != len(data):
        data = data[:end]
    try:
        out = arrays(data)
        return None if out is None else _decode(*out)
    except Exception:  # noqa: BLE001  text that is not UTF-8, a global the unpickler would not treat as a record, ...
        return None


def _decode(ints: list[int], strs: list[str]) -> Metadata | None:
    """`Metadata` from the C reader's output: `ints` and `strs` read in the order `extract` (the C) writes them, one
    section after the other; None (ask the unpickler) where a section is not what the unpickler would read alike."""
    left = iter(strs)
    text = left.__next__
    got = _globals(ints, text)
    if got is None:
        return None
    seen, dtypes = got
    p = 1 + ints[0]
    version = text() if ints[p] else None
    planner, p = _planner_data(ints, p + 1, text, left)
    if planner is None:
        return None
    shapes: dict[tuple, tuple] = {}  # one tuple per distinct shape (a 16 x 8 model: every item's)
    sdm, p = _state_dict_metadata(ints, p, text, dtypes, shapes)
    if sdm is None:
        return None
    where, files, p = _storage_data(ints, p, text, shapes)
    if p != len(ints) or next(left, None) is not None:
        return None
    return Metadata(sdm, where, files, planner, version, frozenset(seen))


def _globals(L: list[int], text) -> tuple[set[str], list[str | None]] | None:
    """(`globals_seen`, the dtype name each global stands for or None) from the globals section at the start of
    `L`. Every global the stream names is in `globals_seen`; one made (NEWOBJ) or called (REDUCE) must be what the
    unpickler would turn into a placeholder record (or torch.Size, called), else None: the unpickler decides."""
    seen, dtypes = set(), []
    for flags in L[1 : 1 + L[0]]:
        module, name = text(), text()
        seen.add(allowlist.dotted(module, name))
        hit = pickle_reader.resolve_global(module, name)
        record = isinstance(hit, type) and issubclass(hit, pickle_reader.Opaque)
        if flags & _NEWOBJ and not record:
            return None
        if flags & _REDUCE and not (record or (module, name) == ("torch", "Size")):
            return None
        dtypes.append(hit.name if isinstance(hit, pickle_reader.DType) else None)
    return seen, dtypes


def _planner_data(L: list[int], p: int, text, left) -> tuple[dict[str, tuple] | None, int]:
    """(`planner_data`, the position after it) from the section at `L[p]` (its count, -1 for none); None for the
    dict where a key is given twice (the unpickler's dict keeps the last)."""
    count = L[p]
    p += 1
    planner: dict[str, tuple] = {}
    if count >= 0:
        for _ in range(count):
            key, n, all_str = text(), L[p], L[p + 1]
            p += 2
            if all_str:
                planner[key] = tuple(islice(left, n))
                continue
            parts = []
            for _ in range(n):
                if L[p] == 1:
                    parts.append(text())
                    p += 1
                else:
                    parts.append(L[p + 1])
                    p += 2
            planner[key] = tuple(parts)
        if len(planner) != count:
            return None, p  # a key given twice: the unpickler's dict keeps the last
    return planner, p


def _state_dict_metadata(
    L: list[int], p: int, text, dtypes: list[str | None], shapes: dict[tuple, tuple]
) -> tuple[dict[str, tuple | None] | None, int]:
    """(`state_dict_metadata`, the position after it) from the section at `L[p]`; None for the dict where a key is
    given twice. Equal shapes, offsets and sizes share one tuple (`shapes`)."""
    count = L[p]
    p += 1
    sdm: dict[str, tuple | None] = {}
    zeros: dict[int, tuple] = {}
    for _ in range(count):
        key, kind = text(), L[p]
        if kind == 2:
            sdm[key] = None
            p += 1
            continue
        g, n = L[p + 1], L[p + 2]
        q = p + 3 + n
        size = tuple(L[p + 3 : q])
        size = shapes.setdefault(size, size)
        if kind == 3:  # one chunk, all of the tensor
            at = zeros.get(n)
            if at is None:
                at = zeros[n] = shapes.setdefault((0,) * n, (0,) * n)
            sdm[key] = (dtypes[g], size, [(at, size)])
            p = q
            continue
        chunks = []
        q += 1
        for _ in range(L[q - 1]):
            n = L[q]
            q += 1 + n
            offsets = tuple(L[q - n : q])
            n = L[q]
            q += 1 + n
            sizes = tuple(L[q - n : q])
            chunks.append((shapes.setdefault(offsets, offsets), shapes.setdefault(sizes, sizes)))
        p = q
        sdm[key] = (dtypes[g], size, chunks)
    if len(sdm) != count:
        return None, p
    return sdm, p


def _storage_data(
    L: list[int], p: int, text, shapes: dict[tuple, tuple]
) -> tuple[dict[tuple, tuple], dict[str, str], int]:
    """(`where`, `files`, the position after them) from the `storage_data` section at `L[p]`."""
    count = L[p]
    p += 1
    where: dict[tuple, tuple] = {}
    files: dict[str, str] = {}
    for _ in range(count):
        fqn, n = text(), L[p]
        if n < 0:
            offsets = None
            p += 1
        else:
            offsets = tuple(L[p + 1 : p + 1 + n])
            offsets = shapes.setdefault(offsets, offsets)
            p += 1 + n
        rel = text()
        if rel not in files:
            files[rel] = fqn
        where[(fqn, offsets)] = (rel, L[p], L[p + 1])
        p += 2
    return where, files, p


_NEWOBJ, _REDUCE = 1, 2

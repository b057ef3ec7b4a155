"""The pickle safety walk (`pickle_walk._walk_expansion`) in C, compiled on first use with the system C compiler
and loaded with ctypes. Optional: without a compiler (or with CKPT_NATIVE=0) `walker()` is None and the Python walk
runs; both give the same answer, because the C walk only ever says "this pickle passes, and ends here" — for any
pickle it would refuse, or cannot follow exactly as the Python walk does (a protocol-0 memo key that is not plain
digits), it says "ask Python", and the Python walk runs on the same bytes and raises its own error.

Why: the walk is a loop over every opcode, about 0.2-0.5 us per opcode in Python: 5.5 CPU-s for the 22 MB `.metadata`
of a 100k-item DCP checkpoint (10M opcodes), more than the rest of opening it. In C: 0.11 s. The source is kept here
as a string (no package data to
ship); the library is cached per user in $CKPT_NATIVE_DIR, else $XDG_CACHE_HOME/ckpt-tools, else
~/.cache/ckpt-tools, under a name holding the source's hash, and used only from a folder the user owns that no one
else can write to.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

#: `pickle_reader.walk_fingerprint()` of the Python walk this C copy mirrors: when the Python walk changes, the C copy
#: is not used (the Python walk runs) until it is brought in line and this is updated (tests/test_native_walk.py)
MIRRORS = "f2d6b105472b3c7d"

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* mirrors pickle_walk._walk_expansion: same kinds, same slot encoding (depth << 40 | width) */
enum { GENERIC, GET, PUT, MEMOIZE, MARKOP, DUP, TUPLE_TO_MARK, NEW_TO_MARK, FILL_TO_MARK, FILL, TUPLE_N, STOP };
#define S 40
#define WMASK ((1ULL << S) - 1)
#define NONE (-1)

typedef struct { uint64_t *v; int64_t n, cap; } u64vec;
typedef struct { int64_t *v; int64_t n, cap; } i64vec;
/* memo: keys below `dn` in a dense array (picklers number their memo 0, 1, 2, ...: MEMOIZE always does), others
   in an open-addressing table; `count` distinct keys in all (MEMOIZE's next key, as Python's len(memo)) */
typedef struct {
    uint64_t *keys, *vals; unsigned char *used; int64_t cap, hcount;
    uint64_t *dvals; unsigned char *dused; int64_t dn, count;
} memo_t;

static int u64push(u64vec *s, uint64_t x) {
    if (s->n == s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 1024;
        uint64_t *v = realloc(s->v, cap * sizeof *v);
        if (!v) return 0;
        s->v = v; s->cap = cap;
    }
    s->v[s->n++] = x;
    return 1;
}

static int i64push(i64vec *s, int64_t x) {
    if (s->n == s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 256;
        int64_t *v = realloc(s->v, cap * sizeof *v);
        if (!v) return 0;
        s->v = v; s->cap = cap;
    }
    s->v[s->n++] = x;
    return 1;
}

/* put_at: stack position -> memo key, NONE when absent or None; index = position + 1 (position -1 occurs) */
static int putat_set(i64vec *p, int64_t pos, int64_t key) {
    int64_t idx = pos + 1;
    while (p->n <= idx) if (!i64push(p, NONE)) return 0;
    p->v[idx] = key;
    return 1;
}

static int64_t putat_get(const i64vec *p, int64_t pos) {
    int64_t idx = pos + 1;
    return idx >= 0 && idx < p->n ? p->v[idx] : NONE;
}

static uint64_t mix(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL; k ^= k >> 33;
    return k;
}

static int64_t hash_find(const memo_t *m, uint64_t key) {
    if (!m->cap) return -1;
    uint64_t mask = (uint64_t)m->cap - 1, h = mix(key) & mask;
    while (m->used[h]) {
        if (m->keys[h] == key) return (int64_t)h;
        h = (h + 1) & mask;
    }
    return -1;
}

/* the value held for `key`, or NULL */
static uint64_t *memo_get(memo_t *m, uint64_t key) {
    if (key < (uint64_t)m->dn) return m->dused[key] ? &m->dvals[key] : NULL;
    int64_t at = hash_find(m, key);
    return at >= 0 ? &m->vals[at] : NULL;
}

static int hash_set(memo_t *m, uint64_t key, uint64_t val) {
    if ((m->hcount + 1) * 2 > m->cap) {
        memo_t n = {0};
        n.cap = m->cap ? m->cap * 2 : 1024;
        n.keys = malloc(n.cap * sizeof *n.keys);
        n.vals = malloc(n.cap * sizeof *n.vals);
        n.used = calloc(n.cap, 1);
        if (!n.keys || !n.vals || !n.used) { free(n.keys); free(n.vals); free(n.used); return 0; }
        for (int64_t i = 0; i < m->cap; i++) {
            if (!m->used[i]) continue;
            uint64_t h = mix(m->keys[i]) & (uint64_t)(n.cap - 1);
            while (n.used[h]) h = (h + 1) & (uint64_t)(n.cap - 1);
            n.used[h] = 1; n.keys[h] = m->keys[i]; n.vals[h] = m->vals[i];
        }
        free(m->keys); free(m->vals); free(m->used);
        m->keys = n.keys; m->vals = n.vals; m->used = n.used; m->cap = n.cap;
    }
    uint64_t mask = (uint64_t)m->cap - 1, h = mix(key) & mask;
    while (m->used[h] && m->keys[h] != key) h = (h + 1) & mask;
    if (!m->used[h]) { m->used[h] = 1; m->keys[h] = key; m->hcount++; m->count++; }
    m->vals[h] = val;
    return 1;
}

static int memo_set(memo_t *m, uint64_t key, uint64_t val) {
    if (key >= (uint64_t)m->dn && key < (uint64_t)(4 * m->count + 4096) && hash_find(m, key) < 0) {
        /* grow the dense part to hold `key` (at most 4x the keys held: a far key stays in the table) */
        int64_t dn = m->dn ? m->dn : 4096;
        while ((uint64_t)dn <= key) dn *= 2;
        uint64_t *v = realloc(m->dvals, dn * sizeof *v);
        if (!v) return 0;
        m->dvals = v;
        unsigned char *u = realloc(m->dused, dn);
        if (!u) return 0;
        m->dused = u;
        memset(u + m->dn, 0, dn - m->dn);
        m->dn = dn;
        if (m->hcount) {  /* keys of the table now in the dense range move there: each key lives in one place */
            uint64_t *keys = m->keys, *vals = m->vals;
            unsigned char *used = m->used;
            int64_t cap = m->cap;
            m->keys = NULL; m->vals = NULL; m->used = NULL; m->cap = 0; m->count -= m->hcount; m->hcount = 0;
            for (int64_t i = 0; i < cap; i++) {
                if (!used[i]) continue;
                if (keys[i] < (uint64_t)dn) { m->dused[keys[i]] = 1; m->dvals[keys[i]] = vals[i]; m->count++; }
                else if (!hash_set(m, keys[i], vals[i])) { free(keys); free(vals); free(used); return 0; }
            }
            free(keys); free(vals); free(used);
        }
    }
    if (key < (uint64_t)m->dn) {
        if (!m->dused[key]) { m->dused[key] = 1; m->count++; }
        m->dvals[key] = val;
        return 1;
    }
    return hash_set(m, key, val);
}

static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }

/* after filling the container memoized under k (NONE: none) to depth d, its memo entry follows (Python's _refill) */
static void refill(memo_t *m, int64_t k, uint64_t d) {
    if (k == NONE) return;
    uint64_t *held = memo_get(m, (uint64_t)k);
    if (held && *held >> S < d) *held = (d << S) | (*held & WMASK);
}

/* the end of the pickle (just past STOP), or -1: refused, not followable as Python follows it, or out of memory */
int64_t ckpt_walk(const unsigned char *d, int64_t end, const int32_t *tab, int64_t max_w, int64_t max_shared,
                  int64_t nesting) {
    u64vec st = {0}; i64vec marks = {0}, putat = {0}; memo_t memo = {0};
    const uint64_t level = 1ULL << S, deep = (uint64_t)(nesting + 1) << S;
    int64_t shared = 0, i = 0, ret = -1;
#define FAIL goto done
#define PUSH(x) do { if (!u64push(&st, (x))) FAIL; } while (0)
#define SP st.n
#define TOP st.v[st.n - 1]
#define TOO_DEEP(v) ((v) >= deep)
#define TOO_WIDE(v) ((int64_t)((v) & WMASK) > max_w)
    while (i < end) {
        unsigned op = d[i];
        switch (op) {  /* the fast paths of _walk_expansion, in its order (none of these opcodes overlap) */
        case 114: {  /* LONG_BINPUT */
            if (i + 5 > end) FAIL;
            uint64_t k = rd32(d + i + 1), v = SP ? TOP : 1;
            if (!memo_set(&memo, k, v)) FAIL;
            if (!(v & WMASK) && !putat_set(&putat, SP - 1, (int64_t)k)) FAIL;
            i += 5; continue;
        }
        case 104: case 106: {  /* BINGET, LONG_BINGET */
            if (i + (op == 104 ? 2 : 5) > end) FAIL;
            uint64_t k = op == 104 ? d[i + 1] : rd32(d + i + 1);
            uint64_t *held = memo_get(&memo, k), v = held ? *held : 1;
            PUSH(v);
            if ((v & WMASK) > 1) { shared += (int64_t)(v & WMASK) - 1; if (shared > max_shared) FAIL; }
            i += op == 104 ? 2 : 5; continue;
        }
        case 75: PUSH(1); i += 2; continue;  /* BININT1 */
        case 40: if (!i64push(&marks, SP)) FAIL; i += 1; continue;  /* MARK */
        case 82: case 129:  /* REDUCE, NEWOBJ */
            if (SP > 1) {
                uint64_t a = st.v[--st.n], b = TOP, m = a > b ? a : b;
                uint64_t v = ((m >> S) + 1) << S;
                TOP = v;
                if (TOO_DEEP(v)) FAIL;
            } else { st.n = 0; PUSH(0); }
            i += 1; continue;
        case 116: {  /* TUPLE */
            int64_t m = marks.n ? marks.v[--marks.n] : 0;
            if (m < SP) {
                uint64_t sum = 0, mx = 0;
                for (int64_t q = m; q < SP; q++) { sum += st.v[q]; if (st.v[q] > mx) mx = st.v[q]; }
                st.n = m;
                uint64_t v = (((mx >> S) + 1) << S) | ((sum & WMASK) + 1);
                PUSH(v);
                if (TOO_DEEP(v) || TOO_WIDE(v)) FAIL;
            } else PUSH(1);
            i += 1; continue;
        }
        case 0x29: case 0x4e: case 0x88: case 0x89: PUSH(1); i += 1; continue;  /* EMPTY_TUPLE NONE NEWTRUE NEWFALSE */
        case 133:  /* TUPLE1 */
            if (SP) {
                uint64_t v = TOP + level + 1;
                TOP = v;
                if (TOO_DEEP(v) || TOO_WIDE(v)) FAIL;
            }
            i += 1; continue;
        case 81:  /* BINPERSID */
            if (SP) {
                uint64_t v = ((TOP >> S) + 1) << S;
                TOP = v;
                if (TOO_DEEP(v)) FAIL;
            }
            i += 1; continue;
        case 88:  /* BINUNICODE */
            if (i + 5 > end) FAIL;
            PUSH(1); i += 5 + (int64_t)rd32(d + i + 1); continue;
        case 140:  /* SHORT_BINUNICODE */
            if (i + 2 > end) FAIL;
            PUSH(1); i += 2 + d[i + 1]; continue;
        case 0x7d: case 0x5d: case 0x8f: PUSH(0); i += 1; continue;  /* EMPTY_DICT, EMPTY_LIST, EMPTY_SET */
        case 148: case 113: {  /* MEMOIZE, BINPUT */
            if (op == 113 && i + 2 > end) FAIL;
            uint64_t k = op == 148 ? (uint64_t)memo.count : d[i + 1], v = SP ? TOP : 1;
            if (!memo_set(&memo, k, v)) FAIL;
            if (!(v & WMASK) && !putat_set(&putat, SP - 1, (int64_t)k)) FAIL;
            i += op == 148 ? 1 : 2; continue;
        }
        case 134:  /* TUPLE2 */
            if (SP > 1) {
                uint64_t a = st.v[--st.n], b = TOP, m = a > b ? a : b;
                uint64_t v = (((m >> S) + 1) << S) | (((a + b) & WMASK) + 1);
                TOP = v;
                if (TOO_DEEP(v) || TOO_WIDE(v)) FAIL;
            } else { st.n = 0; PUSH(1); }
            i += 1; continue;
        case 98: case 97: case 117: case 101: {  /* BUILD, APPEND / SETITEMS, APPENDS */
            uint64_t dd;
            if (op == 98 || op == 97) {
                if (SP < 2) { st.n = 0; i += 1; continue; }
                dd = (st.v[--st.n] >> S) + 1;
            } else {
                int64_t m = marks.n ? marks.v[--marks.n] : 0;
                if (!(0 < m && m < SP)) { if (m < SP) st.n = m; i += 1; continue; }
                uint64_t mx = 0;
                for (int64_t q = m; q < SP; q++) if (st.v[q] > mx) mx = st.v[q];
                dd = (mx >> S) + 1;
                st.n = m;
            }
            uint64_t c = TOP;
            if (dd > c >> S) {
                uint64_t v = (dd << S) | (c & WMASK);
                TOP = v;
                if (TOO_DEEP(v)) FAIL;
                refill(&memo, putat_get(&putat, SP - 1), dd);
            }
            i += 1; continue;
        }
        default: break;
        }
        const int32_t *e = tab + 6 * op;
        if (!e[0]) FAIL;  /* unknown opcode */
        int kind = e[1], n = e[2], two = e[3], pops = e[4], pushes = e[5];
        i += 1;
        uint64_t arg = 0;
        if (n > 0) {
            if (kind == GET || kind == PUT) {
                if (i + n > end) FAIL;
                arg = n == 1 ? d[i] : rd32(d + i);
            }
            i += n;
        } else if (n == -1) {  /* text up to a newline; two lines for GLOBAL / INST */
            const unsigned char *nl = i < end ? memchr(d + i, '\n', (size_t)(end - i)) : NULL;
            if (!nl) FAIL;
            int64_t j = nl - d;
            if (kind == GET || kind == PUT) {  /* plain digits only: Python's int() accepts more */
                if (j - i < 1 || j - i > 18) FAIL;
                for (int64_t q = i; q < j; q++) { if (d[q] < '0' || d[q] > '9') FAIL; arg = arg * 10 + (d[q] - '0'); }
            }
            if (two) {
                const unsigned char *nl2 = j + 1 < end ? memchr(d + j + 1, '\n', (size_t)(end - j - 1)) : NULL;
                if (!nl2) FAIL;
                i = (nl2 - d) + 1;
            } else i = j + 1;
        } else if (n == -2) {
            if (i + 1 > end) FAIL;
            i += 1 + d[i];
        } else if (n == -3 || n == -4) {
            if (i + 4 > end) FAIL;
            i += 4 + (int64_t)rd32(d + i);
        } else if (n == -5) {
            if (i + 8 > end) FAIL;
            uint64_t len = rd64(d + i);
            if (len > (uint64_t)end) FAIL;
            i += 8 + (int64_t)len;
        }
        switch (kind) {
        case GENERIC:
            if (pops) {
                int64_t cnt = pops < SP ? pops : SP;
                uint64_t mx = 0;
                for (int64_t q = SP - cnt; q < SP; q++) if (st.v[q] > mx) mx = st.v[q];
                st.n -= cnt;
                if (pushes) {
                    uint64_t v = cnt ? ((mx >> S) + 1) << S : 0;
                    PUSH(v);
                    if (TOO_DEEP(v)) FAIL;
                }
            } else if (pushes) PUSH(op == 0x7d || op == 0x5d || op == 0x8f ? 0 : 1);
            continue;
        case GET: case DUP: {
            uint64_t v;
            if (kind == GET) {
                uint64_t *held = memo_get(&memo, arg);
                v = held ? *held : 1;
            } else {
                v = SP ? TOP : 1;
                if (!putat_set(&putat, SP, putat_get(&putat, SP - 1))) FAIL;
            }
            PUSH(v);
            if ((v & WMASK) > 1) { shared += (int64_t)(v & WMASK) - 1; if (shared > max_shared) FAIL; }
            continue;
        }
        case PUT: case MEMOIZE: {
            uint64_t k = kind == PUT ? arg : (uint64_t)memo.count, v = SP ? TOP : 1;
            if (!memo_set(&memo, k, v)) FAIL;
            if (!(v & WMASK) && !putat_set(&putat, SP - 1, (int64_t)k)) FAIL;
            continue;
        }
        case MARKOP: if (!i64push(&marks, SP)) FAIL; continue;
        case STOP: ret = i; goto done;
        case FILL: case FILL_TO_MARK: {
            int64_t lo, hi;  /* the items taken in: st.v[lo..hi) */
            if (kind == FILL) {
                int64_t cnt = pops < SP ? pops : SP;
                if (!cnt) continue;  /* nothing popped: Python's `top` is empty */
                lo = SP - cnt + 1; hi = SP;  /* the first popped (the container) goes back where it was */
                st.n = lo;
            } else {
                int64_t m = marks.n ? marks.v[--marks.n] : 0;
                lo = m; hi = SP;
                if (m < SP) st.n = m;
            }
            if (lo >= hi || !SP) continue;
            uint64_t mx = 0;
            for (int64_t q = lo; q < hi; q++) if (st.v[q] > mx) mx = st.v[q];
            uint64_t dd = (mx >> S) + 1, c = TOP;
            if (dd > c >> S) {
                uint64_t v = (dd << S) | (c & WMASK);
                TOP = v;
                if (TOO_DEEP(v)) FAIL;
                refill(&memo, putat_get(&putat, SP - 1), dd);
            }
            continue;
        }
        default: {  /* TUPLE_N; TUPLE, FROZENSET, LIST, DICT, INST, OBJ, POP_MARK */
            int64_t lo, hi;
            if (kind == TUPLE_N) {
                int64_t cnt = pops < SP ? pops : SP;
                lo = SP - cnt; hi = SP; st.n = lo;
            } else {
                int64_t m = marks.n ? marks.v[--marks.n] : 0;
                lo = m; hi = SP;
                if (m < SP) st.n = m;
                if (!pushes) continue;
            }
            uint64_t v;
            if (lo >= hi) v = kind == NEW_TO_MARK ? 0 : 1;
            else {
                uint64_t sum = 0, mx = 0;
                for (int64_t q = lo; q < hi; q++) { sum += st.v[q]; if (st.v[q] > mx) mx = st.v[q]; }
                v = kind == NEW_TO_MARK ? ((mx >> S) + 1) << S : (((mx >> S) + 1) << S) | ((sum & WMASK) + 1);
            }
            PUSH(v);
            if (TOO_DEEP(v) || TOO_WIDE(v)) FAIL;
            continue;
        }
        }
    }
done:
    free(st.v); free(marks.v); free(putat.v); free(memo.keys); free(memo.vals); free(memo.used);
    free(memo.dvals); free(memo.dused);
    return ret;
}
"""

_lock = threading.Lock()
_bound: dict[str, Any] = {}  # library prefix -> what its `bind` returned, or None: tried once per process


def enabled() -> bool:
    """False when CKPT_NATIVE=0 (the tests run the Python walk that way too)."""
    return os.environ.get("CKPT_NATIVE", "1") != "0"


def _cache_dir() -> Path:
    base = os.environ.get("CKPT_NATIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ckpt-tools"
    )
    return Path(base)


def _private(folder: Path) -> bool:
    """The folder is ours and no one else can write to it (a library loaded from it runs as us)."""
    st = folder.stat()
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


def load(source: str, prefix: str, bind: Callable[[ctypes.CDLL], Any]) -> Any:
    """`bind(library)` (its functions with their C types) of the library compiled from the C `source` (`build`,
    cached as `<prefix>-<source hash>-<machine>.so`), once per process; None when native code is switched off
    (CKPT_NATIVE=0) or cannot be built or loaded here (no compiler, no private cache folder, a missing symbol)."""
    if not enabled():
        return None
    with _lock:
        if prefix not in _bound:
            try:
                digest = hashlib.sha256(source.encode()).hexdigest()[:16]
                lib = build(source, f"{prefix}-{digest}-{platform.machine()}.so")
                _bound[prefix] = bind(ctypes.CDLL(str(lib))) if lib is not None else None
            except (OSError, subprocess.SubprocessError, AttributeError):  # no compiler, no cache folder, ...
                _bound[prefix] = None
        return _bound[prefix]


def build(source: str, name: str) -> Path | None:
    """The shared library compiled from the C `source`, cached as `name` in the per-user cache folder (built there
    first when missing); None when that folder is not private to this user. Raises when the compiler fails."""
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _private(folder):
        return None
    lib = folder / name
    if lib.is_file():
        return lib
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = Path(tmp) / "src.c"
        src.write_text(source)
        out = Path(tmp) / name
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
            check=True,
            timeout=120,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.replace(out, lib)  # atomic: a concurrent process finds the whole library or none
    return lib


def walker(table: Sequence[int], max_w: int, max_shared: int, nesting: int) -> Callable[[bytes], int] | None:
    """`walk(data) -> the pickle's length, or -1` (refused, or not followed exactly: ask the Python walk), with
    the opcode table (6 ints per opcode: known, kind, argument size, two lines, pops, pushes) and the bounds given;
    None when the C walk is disabled or cannot be built here."""

    def bind(dll: ctypes.CDLL):
        fn = dll.ckpt_walk
        fn.restype = ctypes.c_int64
        fn.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int64,
            ctypes.POINTER(ctypes.c_int32),
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
        ]
        return fn

    fn = load(SOURCE, "walk", bind)
    if fn is None:
        return None
    tab = (ctypes.c_int32 * len(table))(*table)

    def walk(data: bytes) -> int:
        if not isinstance(data, bytes):
            data = bytes(data)
        return fn(data, len(data), tab, max_w, max_shared, nesting)

    return walk

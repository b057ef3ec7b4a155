"""The pickle safety walk in Python (`pickle_reader.check_expansion` runs it, or its C copy `native_walk`): the opcode
stream walked without building an object, refusing hash bombs and deep nesting. Its source (`_walk_expansion`,
`_refill`, `_op_table`) is what `pickle_reader.walk_fingerprint` hashes.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from typing import Any

from ..errors import CorruptCheckpoint

#: the most items a tuple may expand to (shared sub-tuples counted every time they appear); legitimate
#: checkpoint tuples (shapes, persistent ids, RNG states) stay in the thousands
MAX_TUPLE_EXPANSION = 1_000_000
#: the most expanded tuple items the whole stream may re-reference through the memo or DUP
MAX_SHARED_EXPANSION = 10_000_000
#: the most levels containers may nest (a tuple in a tuple, a dict in a list, an object's state, ...). Hashing a
#: tuple recurses in C without a limit: a 300,000-deep tuple used as a dict key kills the process (SIGSEGV),
#: whichever unpickler builds the dict. The deepest sample pickle nests 18 levels (FSDP1's sharded state dict:
#: ShardedTensor metadata inside optimizer state); 256 also keeps what recurses in Python over the tree clear of
#: its 1,000-frame limit.
MAX_NESTING = 256
_U32, _U64 = struct.Struct("<I").unpack_from, struct.Struct("<Q").unpack_from
# One int per stack slot of the walk: (nesting depth << _DEPTH_SHIFT) | width. One sum() over a tuple's items then gives
# its width in the low bits (the widths summed stay far below 2**40), one max() its deepest item in the high bits, and
# one comparison (>= (MAX_NESTING + 1) << _DEPTH_SHIFT) finds a slot nested too deep. Width: a leaf (a number, a
# string, None, an empty tuple) is 1, a tuple 1 + its items; a dict, list, set or object is 0: it can be filled after
# it is made, and hashing stops at it (unhashable, or hashed by identity) but its walls still count 1 in depth.
_DEPTH_SHIFT = 40
_WIDTH = (1 << _DEPTH_SHIFT) - 1
# what the expansion walk does with an opcode
(_GENERIC, _GET, _PUT, _MEMOIZE, _MARKOP, _DUP, _TUPLE_TO_MARK, _NEW_TO_MARK, _FILL_TO_MARK, _FILL, _TUPLE_N, _STOP) = (
    range(12)
)
#: opcodes pushing a leaf (width 1) / an empty container that may be filled (width 0), without an argument
_LEAF_OPS = frozenset(b")N\x88\x89")  # EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
_EMPTY_CONTAINER_OPS = frozenset(b"}]\x8f")  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
#: the opcodes `_walk_expansion` takes on paths of its own, path by path (the opcodes torch.save's and DCP's pickles are
#: made of, most frequent first); `_FAST[op]`: the path's number, 0 for `_table_op`
_FAST_OPS = (
    (114, 148, 113),  # LONG_BINPUT, MEMOIZE, BINPUT
    (104, 106),  # BINGET, LONG_BINGET
    (75, *_LEAF_OPS),  # BININT1 and the leaves
    (40,),  # MARK
    (82, 129, 134),  # REDUCE, NEWOBJ, TUPLE2
    (116,),  # TUPLE
    (81, 133),  # BINPERSID, TUPLE1
    (88, 140),  # BINUNICODE, SHORT_BINUNICODE
    tuple(_EMPTY_CONTAINER_OPS),
    (98, 97, 117, 101),  # BUILD, APPEND, SETITEMS, APPENDS
)
_FAST = bytes(next((k + 1 for k, ops in enumerate(_FAST_OPS) if op in ops), 0) for op in range(256))
#: opcode byte -> (kind, argument size as pickletools gives it, two text lines?, pops, pushes, name)
_OPS: list[tuple[int, int, bool, int, int, str] | None] = []


def _op_table() -> list:
    if not _OPS:
        _OPS.extend([None] * 256)
        for op in pickletools.opcodes:
            name, to_mark = op.name, pickletools.markobject in op.stack_before
            kind = (
                _GET
                if name in ("GET", "BINGET", "LONG_BINGET")
                else _PUT
                if name in ("PUT", "BINPUT", "LONG_BINPUT")
                else _MEMOIZE
                if name == "MEMOIZE"
                else _MARKOP
                if name == "MARK"
                else _DUP
                if name == "DUP"
                else _TUPLE_TO_MARK
                if name in ("TUPLE", "FROZENSET")
                # fill the container below the MARK (it stays on the stack) / build one from what lies above
                else _FILL_TO_MARK
                if name in ("APPENDS", "SETITEMS", "ADDITEMS")
                else _NEW_TO_MARK
                if to_mark
                else _FILL
                if name in ("APPEND", "SETITEM", "BUILD")
                # fill the container under the items
                else _TUPLE_N
                if name in ("TUPLE1", "TUPLE2", "TUPLE3")
                else _STOP
                if name == "STOP"
                else _GENERIC
            )
            _OPS[ord(op.code)] = (
                kind,
                0 if op.arg is None else op.arg.n,
                name in ("GLOBAL", "INST"),
                0 if to_mark else len(op.stack_before),
                len(op.stack_after),
                name,
            )
    return _OPS


def _walk_expansion(data: bytes, path: str) -> int:
    """`check_expansion`'s walk: the pickle's length. Frequent opcodes first; `_table_op` the others. `i`: past op."""
    table = _op_table()
    stack, marks, memo, put_at = [], [], {}, {}  # slots (see _DEPTH_SHIFT), MARK positions, memo, put_at (_refill)
    push, pop, shared, i, end = stack.append, stack.pop, 0, 0, len(data)
    u32, max_w, max_shared, S, W = _U32, MAX_TUPLE_EXPANSION, MAX_SHARED_EXPANSION, _DEPTH_SHIFT, _WIDTH
    fast, deep = _FAST, (MAX_NESTING + 1) << S  # deep: a slot this large nests too deep
    while i < end:
        f = fast[op := data[i]]
        i += 1
        if f == 1:  # LONG_BINPUT, MEMOIZE, BINPUT
            k = u32(data, i)[0] if op == 114 else len(memo) if op == 148 else data[i]
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            i += 4 if op == 114 else 1 if op == 113 else 0
        elif f == 2:  # BINGET, LONG_BINGET
            v = memo.get(data[i] if op == 104 else u32(data, i)[0], 1)
            push(v)
            if v > 1 and v & W > 1:  # a tuple: hashing the reference hashes its items again
                shared += (v & W) - 1
                if shared > max_shared:
                    _refuse(table, data, i - 1, v, shared, path)
            i += 1 if op == 104 else 4
        elif f == 3:  # BININT1; EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
            push(1)
            i += 1 if op == 75 else 0
        elif f == 4:  # MARK
            marks.append(len(stack))
        elif f == 5:  # REDUCE, NEWOBJ: an object a level above both; TUPLE2: a tuple
            if len(stack) > 1:
                a = pop()
                b = stack[-1]
                v = stack[-1] = (max(a, b) >> S) + 1 << S | (((a + b) & W) + 1 if op == 134 else 0)
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i - 1, v, shared, path)
            else:
                stack[:] = [1 if op == 134 else 0]
        elif f == 6:  # TUPLE: of the items above the topmost MARK
            m = marks.pop() if marks else 0
            top = stack[m:]
            del stack[m:]
            v = ((max(top) >> S) + 1 << S) | ((sum(top) & W) + 1) if top else 1
            push(v)
            if v >= deep or v & W > max_w:
                _refuse(table, data, i - 1, v, shared, path)
        elif f == 7:  # BINPERSID: an id -> the object it names, a level above it; TUPLE1: 1 wider
            if stack:
                v = stack[-1] = (stack[-1] >> S) + 1 << S if op == 81 else stack[-1] + (1 << S) + 1
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i - 1, v, shared, path)
        elif f == 8:  # BINUNICODE, SHORT_BINUNICODE
            push(1)
            i += 4 + u32(data, i)[0] if op == 88 else 1 + data[i]
        elif f == 9:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            push(0)
        elif f == 10:  # BUILD, APPEND / SETITEMS, APPENDS: as in _fill
            if op == 98 or op == 97:
                if len(stack) < 2:
                    stack.clear()
                    continue
                d = (pop() >> S) + 1
            else:
                m = marks.pop() if marks else 0
                if not 0 < m < len(stack):
                    del stack[m:]
                    continue
                d = (max(stack[m:]) >> S) + 1
                del stack[m:]
            c = stack[-1]
            if d > c >> S:
                v = stack[-1] = (d << S) | (c & W)
                if v >= deep:
                    _refuse(table, data, i - 1, v, shared, path)
                _refill(memo, put_at.get(len(stack) - 1), d)
        else:
            i, shared, stopped = _table_op(table, data, i, op, stack, marks, memo, put_at, shared, path)
            if stopped:
                return i
    raise pickle.UnpicklingError("the pickle ends before its STOP opcode")


def _table_op(
    table: list,
    data: bytes,
    i: int,
    op: int,
    stack: list,
    marks: list,
    memo: dict,
    put_at: dict,
    shared: int,
    path: str,
) -> tuple[int, int, bool]:
    """`_walk_expansion`'s path for every other opcode `op` (`i` past its byte), driven by `_op_table`. Returns
    (where the next opcode starts, the tuple items re-referenced so far, whether `op` was STOP)."""
    pos, S, W = i - 1, _DEPTH_SHIFT, _WIDTH
    deep = (MAX_NESTING + 1) << S
    entry = table[op]
    if entry is None:
        raise pickle.UnpicklingError(f"unknown opcode {op:#04x} at byte {pos}")
    kind, n, two_lines, pops, pushes, name = entry
    i, arg = _skip_argument(data, i, kind, n, two_lines)
    if kind == _GENERIC:
        if pops:  # REDUCE, NEWOBJ(_EX), BINPERSID, STACK_GLOBAL, ...: an object made of what was popped
            top = stack[-pops:]
            del stack[-pops:]
            if pushes:
                v = (max(top) >> S) + 1 << S if top else 0
                stack.append(v)
                if v >= deep:
                    _refuse(table, data, pos, v, shared, path)
        elif pushes:  # a leaf, or an empty dict / list / set (width 0: it may be filled)
            stack.append(0 if op in _EMPTY_CONTAINER_OPS else 1)
        return i, shared, False
    if kind == _GET or kind == _DUP:
        if kind == _GET:
            v = memo.get(arg, 1)
        else:
            v = stack[-1] if stack else 1
            put_at[len(stack)] = put_at.get(len(stack) - 1)
        stack.append(v)
        if v & W > 1:
            shared += (v & W) - 1
            if shared > MAX_SHARED_EXPANSION:
                _refuse(table, data, pos, v, shared, path)
        return i, shared, False
    if kind == _PUT or kind == _MEMOIZE:
        k = arg if kind == _PUT else len(memo)
        v = memo[k] = stack[-1] if stack else 1
        if not v & W:
            put_at[len(stack) - 1] = k
    elif kind == _MARKOP:
        marks.append(len(stack))
    elif kind == _STOP:
        return i, shared, True
    elif kind == _FILL or kind == _FILL_TO_MARK:  # SETITEM, ADDITEMS and the fast ones in `_walk_expansion`
        _fill(table, data, pos, kind, pops, stack, marks, memo, put_at, shared, path)
    else:
        _make_container(table, data, pos, kind, pops, pushes, stack, marks, shared, path)
    return i, shared, False


def _skip_argument(data: bytes, i: int, kind: int, n: int, two_lines: bool) -> tuple[int, Any]:
    """(where the opcode's argument of size `n` (as pickletools gives it) starting at `i` ends, the memo key it
    holds for a GET or PUT, else None)."""
    arg = None
    if n > 0:
        if kind == _GET or kind == _PUT:
            arg = data[i] if n == 1 else _U32(data, i)[0]
        i += n
    elif n == -1:  # text up to a newline (two lines for GLOBAL / INST)
        j = data.index(b"\n", i)
        if kind == _GET or kind == _PUT:
            arg = int(data[i:j])
        i = data.index(b"\n", j + 1) + 1 if two_lines else j + 1
    elif n == -2:  # one-byte length prefix
        i += 1 + data[i]
    elif n == -3 or n == -4:  # four-byte length prefix
        i += 4 + _U32(data, i)[0]
    elif n == -5:  # eight-byte length prefix
        i += 8 + _U64(data, i)[0]
    return i, arg


def _fill(
    table: list,
    data: bytes,
    pos: int,
    kind: int,
    pops: int,
    stack: list,
    marks: list,
    memo: dict,
    put_at: dict,
    shared: int,
    path: str,
) -> None:
    """SETITEM, ADDITEMS, ...: the container under the items (`_FILL`) or under the MARK (`_FILL_TO_MARK`) takes
    them in and stays on the stack, one level above its new deepest item."""
    S, W = _DEPTH_SHIFT, _WIDTH
    if kind == _FILL:
        top = stack[-pops:]
        del stack[-pops:]
        if top:
            stack.append(top.pop(0))
    else:
        m = marks.pop() if marks else 0
        top = stack[m:]
        del stack[m:]
    if not top or not stack:
        return
    d = (max(top) >> S) + 1
    c = stack[-1]
    if d > c >> S:
        v = stack[-1] = (d << S) | (c & W)
        if v >= (MAX_NESTING + 1) << S:
            _refuse(table, data, pos, v, shared, path)
        _refill(memo, put_at.get(len(stack) - 1), d)


def _make_container(
    table: list,
    data: bytes,
    pos: int,
    kind: int,
    pops: int,
    pushes: int,
    stack: list,
    marks: list,
    shared: int,
    path: str,
) -> None:
    """TUPLE1-3 (`_TUPLE_N`), TUPLE, FROZENSET (`_TUPLE_TO_MARK`), LIST, DICT, INST, OBJ (`_NEW_TO_MARK`), POP_MARK:
    a tuple or frozenset as wide as its items together, a list, dict or object of width 0, a level above them."""
    S, W = _DEPTH_SHIFT, _WIDTH
    if kind == _TUPLE_N:
        top = stack[-pops:]
        del stack[-pops:]
    else:  # what lies above the topmost MARK
        m = marks.pop() if marks else 0
        top = stack[m:]
        del stack[m:]
        if not pushes:
            return
    if kind == _NEW_TO_MARK:  # a list, dict or object: width 0
        v = (max(top) >> S) + 1 << S if top else 0
    else:  # a tuple or frozenset: its items are hashed, it is as wide as they are together
        v = ((max(top) >> S) + 1 << S) | ((sum(top) & W) + 1) if top else 1
    stack.append(v)
    if v >= (MAX_NESTING + 1) << S or v & W > MAX_TUPLE_EXPANSION:
        _refuse(table, data, pos, v, shared, path)


def _refill(memo: dict, k, d: int) -> None:
    """The container memoized under `k` was filled to depth `d`: its memo entry follows.

    The walk's `put_at` maps a stack position to the memo key of the container PUT from there. Picklers memoize a
    dict, list or object as soon as it is made and fill it after (`}` BINPUT, then SETITEMS: every dict torch.save
    writes): filling it raises its memo entry too, so that a later GET carries the depth it was filled to, not the
    depth it had empty. (A key left there by a container since popped can only make a depth come out higher.)"""
    held = memo.get(k) if k is not None else None
    if held is not None and held >> _DEPTH_SHIFT < d:
        memo[k] = (d << _DEPTH_SHIFT) | (held & _WIDTH)


def _refuse(table, data: bytes, pos: int, v: int, shared: int, path: str) -> None:
    """Raise CorruptCheckpoint for the slot `v` the opcode at `pos` made: nested too deep, or too wide."""
    op = table[data[pos]][5]
    if v >> _DEPTH_SHIFT > MAX_NESTING:
        raise CorruptCheckpoint(
            f"pickle nests more than {MAX_NESTING} levels (opcode {op} at byte {pos}): "
            "hashing or walking it would overflow the stack",
            path=path,
            hint="the file is hostile or corrupt; do not load it with torch.load or pickle either",
        )
    w = v & _WIDTH
    what = (
        f"builds a tuple of more than {MAX_TUPLE_EXPANSION:,} items"
        if w > MAX_TUPLE_EXPANSION
        else f"re-references more than {MAX_SHARED_EXPANSION:,} tuple items"
    )
    raise CorruptCheckpoint(
        f"pickle {what} out of shared references (opcode {op} at byte {pos}): a hash bomb",
        path=path,
        hint="the file is hostile or corrupt; do not load it with torch.load either",
    )

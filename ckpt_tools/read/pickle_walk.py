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
# a walk's stack slot packs (nesting depth << _DEPTH_SHIFT) | expanded width (see _walk_expansion)
_DEPTH_SHIFT = 40
_WIDTH = (1 << _DEPTH_SHIFT) - 1
# what the expansion walk does with an opcode
(_GENERIC, _GET, _PUT, _MEMOIZE, _MARKOP, _DUP, _TUPLE_TO_MARK, _NEW_TO_MARK, _FILL_TO_MARK, _FILL, _TUPLE_N, _STOP) = (
    range(12)
)
#: opcodes pushing a leaf (width 1) / an empty container that may be filled (width 0), without an argument
_LEAF_OPS = frozenset(b")N\x88\x89")  # EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
_EMPTY_CONTAINER_OPS = frozenset(b"}]\x8f")  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
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
    table = _op_table()
    # One int per stack slot: (nesting depth << _DEPTH_SHIFT) | width. One sum() over a tuple's items then gives
    # its width in the low bits (the widths summed stay far below 2**40), one max() its deepest item in the high
    # bits, and one comparison (>= deep) finds a slot nested too deep. Width: a leaf (a number, a string, None,
    # an empty tuple) is 1, a tuple 1 + its items; a dict, list, set or object is 0: it can be filled after it
    # is made, and hashing stops at it (unhashable, or hashed by identity) but its walls still count 1 in depth.
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    # stack position -> the memo key of the container PUT from there. Picklers memoize a dict, list or object as
    # soon as it is made and fill it after (`}` BINPUT, then SETITEMS: every dict torch.save writes): filling it
    # raises its memo entry too, so that a later GET carries the depth it was filled to, not the depth it had
    # empty. (A key left there by a container since popped can only make a depth come out higher.)
    put_at: dict[int, Any] = {}
    push, pop, shared, i, end = stack.append, stack.pop, 0, 0, len(data)
    u32, max_w, max_shared, S, W = _U32, MAX_TUPLE_EXPANSION, MAX_SHARED_EXPANSION, _DEPTH_SHIFT, _WIDTH
    leaves, empties = _LEAF_OPS, _EMPTY_CONTAINER_OPS
    level = 1 << S  # one level of depth, in slot units
    deep = (MAX_NESTING + 1) << S  # a slot at least this large nests more than MAX_NESTING levels
    while i < end:
        op = data[i]
        # the opcodes torch.save's protocol-2 pickles are made of, most frequent first; the table-driven path
        # below handles every opcode (these included) the same way, at about twice the cost per opcode
        if op == 114:  # LONG_BINPUT
            k = u32(data, i + 1)[0]
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            i += 5
            continue
        if op == 104 or op == 106:  # BINGET, LONG_BINGET
            v = memo.get(data[i + 1] if op == 104 else u32(data, i + 1)[0], 1)
            push(v)
            if v > 1 and v & W > 1:  # a tuple: hashing the reference hashes its items again
                shared += (v & W) - 1
                if shared > max_shared:
                    _refuse(table, data, i, v, shared, path)
            i += 2 if op == 104 else 5
            continue
        if op == 75:  # BININT1
            push(1)
            i += 2
            continue
        if op == 40:  # MARK
            marks.append(len(stack))
            i += 1
            continue
        if op == 82 or op == 129:  # REDUCE, NEWOBJ: callable/class and arguments -> an object a level above both
            if len(stack) > 1:
                v = (max(pop(), stack[-1]) >> S) + 1 << S
                stack[-1] = v
                if v >= deep:
                    _refuse(table, data, i, v, shared, path)
            else:
                stack[:] = [0]
            i += 1
            continue
        if op == 116:  # TUPLE: of the items above the topmost MARK
            m = marks.pop() if marks else 0
            if m < len(stack):
                top = stack[m:]
                del stack[m:]
                v = ((max(top) >> S) + 1 << S) | ((sum(top) & W) + 1)
                push(v)
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i, v, shared, path)
            else:
                push(1)
            i += 1
            continue
        if op in leaves:  # EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
            push(1)
            i += 1
            continue
        if op == 133:  # TUPLE1: one item wider, one level deeper
            if stack:
                v = stack[-1] + level + 1
                stack[-1] = v
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i, v, shared, path)
            i += 1
            continue
        if op == 81:  # BINPERSID: a persistent id -> the object it names (a storage), a level above it
            if stack:
                v = (stack[-1] >> S) + 1 << S
                stack[-1] = v
                if v >= deep:
                    _refuse(table, data, i, v, shared, path)
            i += 1
            continue
        if op == 88 or op == 140:  # BINUNICODE, SHORT_BINUNICODE
            push(1)
            i += 5 + u32(data, i + 1)[0] if op == 88 else 2 + data[i + 1]
            continue
        if op in empties:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            push(0)
            i += 1
            continue
        if op == 148 or op == 113:  # MEMOIZE, BINPUT
            k = len(memo) if op == 148 else data[i + 1]
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            i += 1 if op == 148 else 2
            continue
        if op == 134:  # TUPLE2
            if len(stack) > 1:
                a = pop()
                b = stack[-1]
                v = ((max(a, b) >> S) + 1 << S) | (((a + b) & W) + 1)
                stack[-1] = v
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i, v, shared, path)
            else:
                stack[:] = [1]
            i += 1
            continue
        if op == 98 or op == 97 or op == 117 or op == 101:
            # BUILD, APPEND / SETITEMS, APPENDS: the object or list under the item (under the MARK) takes in what
            # lies above it and stays on the stack, one level above its new deepest item
            if op == 98 or op == 97:
                if len(stack) < 2:
                    stack.clear()
                    i += 1
                    continue
                d = (pop() >> S) + 1
            else:
                m = marks.pop() if marks else 0
                if not 0 < m < len(stack):
                    del stack[m:]
                    i += 1
                    continue
                d = (max(stack[m:]) >> S) + 1
                del stack[m:]
            c = stack[-1]
            if d > c >> S:
                v = stack[-1] = (d << S) | (c & W)
                if v >= deep:
                    _refuse(table, data, i, v, shared, path)
                _refill(memo, put_at.get(len(stack) - 1), d)
            i += 1
            continue
        pos = i
        entry = table[op]
        if entry is None:
            raise pickle.UnpicklingError(f"unknown opcode {op:#04x} at byte {pos}")
        kind, n, two_lines, pops, pushes, name = entry
        i += 1
        arg = None
        if n > 0:
            if kind == _GET or kind == _PUT:
                arg = data[i] if n == 1 else u32(data, i)[0]
            i += n
        elif n == -1:  # text up to a newline (two lines for GLOBAL / INST)
            j = data.index(b"\n", i)
            if kind == _GET or kind == _PUT:
                arg = int(data[i:j])
            i = data.index(b"\n", j + 1) + 1 if two_lines else j + 1
        elif n == -2:  # one-byte length prefix
            i += 1 + data[i]
        elif n == -3 or n == -4:  # four-byte length prefix
            i += 4 + u32(data, i)[0]
        elif n == -5:  # eight-byte length prefix
            i += 8 + _U64(data, i)[0]
        if kind == _GENERIC:
            if pops:  # REDUCE, NEWOBJ(_EX), BINPERSID, STACK_GLOBAL, ...: an object made of what was popped
                top = stack[-pops:]
                del stack[-pops:]
                if pushes:
                    v = (max(top) >> S) + 1 << S if top else 0
                    push(v)
                    if v >= deep:
                        _refuse(table, data, pos, v, shared, path)
            elif pushes:  # a leaf, or an empty dict / list / set (width 0: it may be filled)
                push(0 if op in empties else 1)
            continue
        if kind == _GET or kind == _DUP:
            if kind == _GET:
                v = memo.get(arg, 1)
            else:
                v = stack[-1] if stack else 1
                put_at[len(stack)] = put_at.get(len(stack) - 1)
            push(v)
            if v & W > 1:
                shared += (v & W) - 1
                if shared > max_shared:
                    _refuse(table, data, pos, v, shared, path)
            continue
        if kind == _PUT or kind == _MEMOIZE:
            k = arg if kind == _PUT else len(memo)
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            continue
        if kind == _MARKOP:
            marks.append(len(stack))
            continue
        if kind == _STOP:
            return i
        if kind == _FILL or kind == _FILL_TO_MARK:  # SETITEM, ADDITEMS and the fast ones above
            if kind == _FILL:
                top = stack[-pops:]
                del stack[-pops:]
                if top:
                    push(top.pop(0))
            else:
                m = marks.pop() if marks else 0
                top = stack[m:]
                del stack[m:]
            if not top or not stack:
                continue
            d = (max(top) >> S) + 1
            c = stack[-1]
            if d > c >> S:
                v = stack[-1] = (d << S) | (c & W)
                if v >= deep:
                    _refuse(table, data, pos, v, shared, path)
                _refill(memo, put_at.get(len(stack) - 1), d)
            continue
        if kind == _TUPLE_N:
            top = stack[-pops:]
            del stack[-pops:]
        else:  # TUPLE, FROZENSET, LIST, DICT, INST, OBJ, POP_MARK: what lies above the topmost MARK
            m = marks.pop() if marks else 0
            top = stack[m:]
            del stack[m:]
            if not pushes:
                continue
        if kind == _NEW_TO_MARK:  # a list, dict or object: width 0
            v = (max(top) >> S) + 1 << S if top else 0
        else:  # a tuple or frozenset: its items are hashed, it is as wide as they are together
            v = ((max(top) >> S) + 1 << S) | ((sum(top) & W) + 1) if top else 1
        push(v)
        if v >= deep or v & W > max_w:
            _refuse(table, data, pos, v, shared, path)
    raise pickle.UnpicklingError("the pickle ends before its STOP opcode")


def _refill(memo: dict, k, d: int) -> None:
    """The container memoized under `k` was filled to depth `d`: its memo entry follows."""
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

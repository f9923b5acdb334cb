"""A corpus of hostile pickles, written opcode by opcode (protocols 0-5), and the tools that plant them
into copies of real checkpoints with manifest.json's size and xxh3 checksum made to match.

Every payload that could run leaves a trace: it runs ``touch SENTINEL`` (or writes SENTINEL), so a
test proves it did NOT run by the sentinel's absence. ``build(sentinel, real_metadata)`` returns the
pickle bytes; ``real_metadata`` is the genuine ``.metadata`` pickle of the victim checkpoint, for the
cases that run the payload and then return the real object.
"""

from __future__ import annotations

import copyreg
import io
import json
import pickle
import shlex
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpt.commit.hashing import hash_file

EXT_CODE = 0xF00D  # registered in copyreg's extension registry by the test that uses EXT opcodes
EXT_CODE1 = 0xE7  # one-byte code for EXT1
EXT_CODE4 = 0x7FFFF00D
EXT_CODE_CACHED = (
    0x7E57  # only in copyreg's extension *cache* (never registered): both stdlib unpicklers look there first
)
_MD = "torch.distributed.checkpoint.metadata"


# ------------------------------------------------------------------------------------ opcodes
def sbu(s: str) -> bytes:
    """SHORT_BINUNICODE (protocol 4+)."""
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def bu(s: str) -> bytes:
    """BINUNICODE (protocol 1+)."""
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def u0(s: str) -> bytes:
    """UNICODE (protocol 0, text)."""
    return b"V" + s.encode("raw-unicode-escape") + b"\n"


def glob(module: str, name: str) -> bytes:
    """GLOBAL (text module/name, any protocol)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def sglob(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4+)."""
    return sbu(module) + sbu(name) + b"\x93"


P0, P2, P3, P4, P5 = b"", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"
MARK, TUPLE, TUPLE1, TUPLE2, TUPLE3, EMPTY_TUPLE = b"(", b"t", b"\x85", b"\x86", b"\x87", b")"
REDUCE, BUILD, NEWOBJ, NEWOBJ_EX, OBJ, STOP, POP, POP_MARK = b"R", b"b", b"\x81", b"\x92", b"o", b".", b"0", b"1"
EMPTY_DICT, SETITEM, EMPTY_LIST, APPEND, NONE, NEWTRUE, NEWFALSE = b"}", b"s", b"]", b"a", b"N", b"\x88", b"\x89"
BINPERSID, MEMOIZE = b"Q", b"\x94"


def binbytes(b: bytes) -> bytes:
    """BINBYTES (protocol 3+)."""
    return b"B" + struct.pack("<I", len(b)) + b


def binint(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def cmd(sentinel: Path) -> str:
    return f"touch {shlex.quote(str(sentinel))}"


def call(func: bytes, *args: bytes) -> bytes:
    """func(*args) through MARK ... TUPLE REDUCE."""
    return func + MARK + b"".join(args) + TUPLE + REDUCE


def os_system(sentinel: Path, proto4: bool = True) -> bytes:
    g = sglob("os", "system") if proto4 else glob("os", "system")
    return call(g, sbu(cmd(sentinel)) if proto4 else bu(cmd(sentinel)))


def _body(real: bytes) -> bytes:
    """The opcodes of a protocol-4 pickle without PROTO, its first FRAME header and STOP (its memo indices
    start at 0, so no opcode of ours before it may memoize)."""
    assert real[:2] == P4 and real[-1:] == STOP
    body = real[2:-1]
    return body[9:] if body[:1] == b"\x95" else body


# ------------------------------------------------------------------------------------ corpus
@dataclass(frozen=True)
class Hostile:
    name: str
    build: Callable[[Path, bytes], bytes]  # (sentinel, genuine .metadata pickle) -> hostile pickle
    note: str


def _h(name: str, note: str) -> Callable[[Callable[[Path, bytes], bytes]], Hostile]:
    def wrap(fn: Callable[[Path, bytes], bytes]) -> Hostile:
        return Hostile(name, fn, note)

    return wrap


def _storage_pid(storage: str = "FloatStorage", key: str = "0", numel: int = 4) -> bytes:
    return MARK + sbu("storage") + sglob("torch", storage) + sbu(key) + sbu("cpu") + binint(numel) + TUPLE + BINPERSID


def _rebuild(storage_pid: bytes, size: bytes, hooks: bytes = EMPTY_DICT, extra: bytes = b"") -> bytes:
    """torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, hooks[, extra])."""
    return call(
        sglob("torch._utils", "_rebuild_tensor_v2"),
        storage_pid,
        binint(0),
        size,
        MARK + binint(1) + TUPLE,
        NEWFALSE,
        hooks,
        extra,
    )


CORPUS: list[Hostile] = [
    _h("dotted-dcp-filesystem-os.system", "protocol 4 getattr chain through a DCP module")(
        lambda s, r: P4 + call(sglob("torch.distributed.checkpoint.filesystem", "os.system"), sbu(cmd(s))) + STOP
    ),
    _h("dotted-dcp-metadata-os.system", "the allow-listed prefix, a dotted name")(
        lambda s, r: P4 + call(sglob("torch.distributed.checkpoint.metadata", "os.system"), sbu(cmd(s))) + STOP
    ),
    _h("dotted-torch-os.system", "torch.os.system")(
        lambda s, r: P4 + call(sglob("torch", "os.system"), sbu(cmd(s))) + STOP
    ),
    _h("dotted-serialization-pickle.loads", "torch.serialization.pickle.loads of an inner payload")(
        lambda s, r: P4 + call(sglob("torch.serialization", "pickle.loads"), binbytes(P4 + os_system(s) + STOP)) + STOP
    ),
    _h("dotted-metadata-class-attr", "Metadata.__init__.__globals__ style chain")(
        lambda s, r: P4 + call(sglob("torch.distributed.checkpoint.metadata", "Metadata.__init__"), NONE) + STOP
    ),
    _h("global-os.system-proto0", "text GLOBAL + REDUCE, protocol 0")(
        lambda s, r: glob("os", "system") + MARK + u0(cmd(s)) + TUPLE + REDUCE + STOP
    ),
    _h("global-os.system-proto2", "GLOBAL + REDUCE, protocol 2 (torch.save's)")(
        lambda s, r: P2 + os_system(s, proto4=False) + STOP
    ),
    _h("stack-global-os.system-proto5", "STACK_GLOBAL, protocol 5")(lambda s, r: P5 + os_system(s) + STOP),
    _h("posix.system", "the os module's C backend")(
        lambda s, r: P4 + call(sglob("posix", "system"), sbu(cmd(s))) + STOP
    ),
    _h("subprocess.Popen", "REDUCE Popen(['sh', '-c', ...])")(
        lambda s, r: (
            P4
            + call(sglob("subprocess", "Popen"), EMPTY_LIST + MARK + sbu("sh") + sbu("-c") + sbu(cmd(s)) + b"e")
            + STOP
        )
    ),
    _h("inst-os.system", "INST opcode, protocol 0")(lambda s, r: MARK + u0(cmd(s)) + b"ios\nsystem\n" + STOP),
    _h("obj-os.system", "OBJ opcode, protocol 1")(lambda s, r: MARK + glob("os", "system") + bu(cmd(s)) + OBJ + STOP),
    _h("newobj-popen", "NEWOBJ of subprocess.Popen, then BUILD")(
        lambda s, r: P2 + glob("subprocess", "Popen") + MARK + bu(cmd(s)) + TUPLE + NEWOBJ + EMPTY_DICT + BUILD + STOP
    ),
    _h("newobj-ex-popen", "NEWOBJ_EX of subprocess.Popen with kwargs")(
        lambda s, r: (
            P4
            + sglob("subprocess", "Popen")
            + MARK
            + sbu(cmd(s))
            + TUPLE
            + EMPTY_DICT
            + sbu("shell")
            + NEWTRUE
            + SETITEM
            + NEWOBJ_EX
            + STOP
        )
    ),
    _h("newobj-allowed-class-with-args", "NEWOBJ of an admitted class with arguments")(
        lambda s, r: (
            P4 + sglob("torch.distributed.checkpoint.metadata", "Metadata") + MARK + sbu(cmd(s)) + TUPLE + NEWOBJ + STOP
        )
    ),
    _h("builtins.eval", "eval of __import__('os').system")(
        lambda s, r: P4 + call(sglob("builtins", "eval"), sbu(f"__import__('os').system({cmd(s)!r})")) + STOP
    ),
    _h("builtins.exec", "exec of an import + system")(
        lambda s, r: P4 + call(sglob("builtins", "exec"), sbu(f"import os; os.system({cmd(s)!r})")) + STOP
    ),
    _h("builtins.getattr+__import__", "getattr(__import__('os'), 'system')(cmd)")(
        lambda s, r: (
            P4
            + call(
                call(sglob("builtins", "getattr"), call(sglob("builtins", "__import__"), sbu("os")), sbu("system")),
                sbu(cmd(s)),
            )
            + STOP
        )
    ),
    _h("builtins.__import__-proto2", "__import__ through GLOBAL, protocol 2 (__builtin__ spelling)")(
        lambda s, r: (
            P2
            + call(
                call(glob("__builtin__", "getattr"), call(glob("__builtin__", "__import__"), bu("os")), bu("system")),
                bu(cmd(s)),
            )
            + STOP
        )
    ),
    _h("copyreg._reconstructor", "_reconstructor(Popen, Popen, argv) calls Popen.__init__")(
        lambda s, r: (
            P4
            + call(
                sglob("copyreg", "_reconstructor"),
                sglob("subprocess", "Popen"),
                sglob("subprocess", "Popen"),
                EMPTY_LIST + MARK + sbu("sh") + sbu("-c") + sbu(cmd(s)) + b"e",
            )
            + STOP
        )
    ),
    _h("copyreg.__newobj__", "__newobj__(Popen, argv)")(
        lambda s, r: P4 + call(sglob("copyreg", "__newobj__"), sglob("subprocess", "Popen"), sbu(cmd(s))) + STOP
    ),
    _h("functools.partial", "partial(os.system, cmd)()")(
        lambda s, r: (
            P4 + call(sglob("functools", "partial"), sglob("os", "system"), sbu(cmd(s))) + EMPTY_TUPLE + REDUCE + STOP
        )
    ),
    _h("rebuild-tensor-nested-reduce", "_rebuild_tensor_v2 whose size is os.system(cmd)")(
        lambda s, r: P4 + _rebuild(_storage_pid(), MARK + os_system(s) + TUPLE) + STOP
    ),
    _h("rebuild-tensor-foreign-hook", "_rebuild_tensor_v2 with backward_hooks {0: builtins.exec}")(
        lambda s, r: (
            P4
            + _rebuild(
                _storage_pid(),
                MARK + binint(1) + TUPLE,
                hooks=EMPTY_DICT + binint(0) + sglob("builtins", "exec") + SETITEM,
            )
            + STOP
        )
    ),
    _h("rebuild-tensor-admitted-hook", "_rebuild_tensor_v2 with backward_hooks {0: OrderedDict}")(
        lambda s, r: (
            P4
            + _rebuild(
                _storage_pid(),
                MARK + binint(1) + TUPLE,
                hooks=EMPTY_DICT + binint(0) + sglob("collections", "OrderedDict") + SETITEM,
            )
            + STOP
        )
    ),
    _h("rebuild-tensor-metadata", "_rebuild_tensor_v2 with tensor metadata (a setter of tensor internals)")(
        lambda s, r: (
            P4
            + _rebuild(_storage_pid(), MARK + binint(1) + TUPLE, extra=EMPTY_DICT + sbu("conj") + NEWTRUE + SETITEM)
            + STOP
        )
    ),
    _h("rebuild-tensor-out-of-bounds", "a view far past its storage (reads foreign memory if unchecked)")(
        lambda s, r: (
            P4
            + call(
                sglob("torch._utils", "_rebuild_tensor_v2"),
                _storage_pid(numel=4),
                binint(1 << 30),
                MARK + binint(4) + TUPLE,
                MARK + binint(1) + TUPLE,
                NEWFALSE,
                EMPTY_DICT,
            )
            + STOP
        )
    ),
    _h("rebuild-parameter-hooks", "_rebuild_parameter with hooks")(
        lambda s, r: (
            P4
            + call(
                sglob("torch._utils", "_rebuild_parameter"),
                _rebuild(_storage_pid(), MARK + binint(1) + TUPLE),
                NEWFALSE,
                EMPTY_DICT + binint(0) + sglob("os", "system") + SETITEM,
            )
            + STOP
        )
    ),
    _h("rebuild-from-type-admitted-func", "_rebuild_from_type_v2(OrderedDict, Tensor, ...): not a tensor rebuild")(
        lambda s, r: (
            P2
            + call(
                glob("torch._tensor", "_rebuild_from_type_v2"),
                glob("collections", "OrderedDict"),
                glob("torch", "Tensor"),
                EMPTY_TUPLE,
                EMPTY_DICT,
            )
            + STOP
        )
    ),
    _h("rebuild-from-type-grad-attr", "_rebuild_from_type_v2 whose state replaces the tensor's .data")(
        lambda s, r: (
            P2
            + call(
                glob("torch._tensor", "_rebuild_from_type_v2"),
                glob("torch._utils", "_rebuild_tensor_v2"),
                glob("torch", "Tensor"),
                MARK
                + _storage_pid()
                + binint(0)
                + MARK
                + binint(1)
                + TUPLE
                + MARK
                + binint(1)
                + TUPLE
                + NEWFALSE
                + EMPTY_DICT
                + TUPLE,
                EMPTY_DICT + bu("data") + binint(1) + SETITEM,
            )
            + STOP
        )
    ),
    _h("torch.load", "torch.load of another path")(
        lambda s, r: P4 + call(sglob("torch", "load"), sbu(str(s) + ".evil.pt")) + STOP
    ),
    _h("torch.serialization.load", "torch.serialization.load")(
        lambda s, r: P4 + call(sglob("torch.serialization", "load"), sbu(str(s) + ".evil.pt")) + STOP
    ),
    _h("pickle.loads", "pickle.loads of an inner os.system pickle")(
        lambda s, r: P4 + call(sglob("pickle", "loads"), binbytes(P4 + os_system(s) + STOP)) + STOP
    ),
    _h("numpy._reconstruct", "numpy.core.multiarray._reconstruct")(
        lambda s, r: (
            P2
            + call(
                glob("numpy.core.multiarray", "_reconstruct"),
                glob("numpy", "ndarray"),
                MARK + binint(0) + TUPLE,
                bu("b"),
            )
            + STOP
        )
    ),
    _h("metadata-build-setstate-os.system", "Metadata NEWOBJ, BUILD sets __setstate__ = os.system, BUILD calls it")(
        lambda s, r: (
            P4
            + sglob("torch.distributed.checkpoint.metadata", "Metadata")
            + EMPTY_TUPLE
            + NEWOBJ
            + NONE
            + EMPTY_DICT
            + sbu("__setstate__")
            + sglob("os", "system")
            + SETITEM
            + TUPLE2
            + BUILD
            + sbu(cmd(s))
            + BUILD
            + STOP
        )
    ),
    _h("metadata-build-setstate-admitted", "the same trick with an admitted callable only")(
        lambda s, r: (
            P4
            + sglob("torch.distributed.checkpoint.metadata", "Metadata")
            + EMPTY_TUPLE
            + NEWOBJ
            + NONE
            + EMPTY_DICT
            + sbu("__setstate__")
            + sglob("collections", "OrderedDict")
            + SETITEM
            + TUPLE2
            + BUILD
            + EMPTY_DICT
            + BUILD
            + STOP
        )
    ),
    _h("build-on-class", "BUILD on an admitted class object (patches it for the whole process)")(
        lambda s, r: (
            P4
            + sglob("torch.distributed.checkpoint.metadata", "Metadata")
            + NONE
            + EMPTY_DICT
            + sbu("__reduce__")
            + sglob("collections", "OrderedDict")
            + SETITEM
            + TUPLE2
            + BUILD
            + STOP
        )
    ),
    _h("appends-on-instance", "APPENDS on a Metadata instance (calls its .extend attribute)")(
        lambda s, r: (
            P4
            + sglob("torch.distributed.checkpoint.metadata", "Metadata")
            + EMPTY_TUPLE
            + NEWOBJ
            + MARK
            + binint(1)
            + b"e"
            + STOP
        )
    ),
    _h("ext1", "EXT1 through copyreg's extension registry -> os.system")(
        lambda s, r: P2 + b"\x82" + bytes([EXT_CODE1]) + MARK + bu(cmd(s)) + TUPLE + REDUCE + STOP
    ),
    _h("ext2", "EXT2 through copyreg's extension registry -> posix.system")(
        lambda s, r: P2 + b"\x83" + struct.pack("<H", EXT_CODE) + MARK + bu(cmd(s)) + TUPLE + REDUCE + STOP
    ),
    _h("ext4", "EXT4 through copyreg's extension registry -> subprocess.getoutput")(
        lambda s, r: P2 + b"\x84" + struct.pack("<i", EXT_CODE4) + MARK + bu(cmd(s)) + TUPLE + REDUCE + STOP
    ),
    _h("ext2-cache-only", "EXT2 of a code found only in copyreg's extension cache (no find_class call) -> os.system")(
        lambda s, r: P2 + b"\x83" + struct.pack("<H", EXT_CODE_CACHED) + MARK + bu(cmd(s)) + TUPLE + REDUCE + STOP
    ),
    # What an engine that cannot check opcodes one by one (the C unpickler with only find_class overridden) would let
    # through; each is refused here, so a change of engine that lets one through fails this corpus.
    _h("huge-memo-index-long-binput", "LONG_BINPUT 0xFFFFFFFF (the C unpickler zero-fills a 64 GiB memo for it)")(
        lambda s, r: P2 + NONE + b"r" + struct.pack("<I", 0xFFFFFFFF) + STOP
    ),
    _h("huge-memo-index-put", "text PUT 4000000000, protocol 0")(lambda s, r: b"N" + b"p4000000000\n" + STOP),
    _h("build-on-dict", "BUILD on a plain dict")(
        lambda s, r: P4 + EMPTY_DICT + EMPTY_DICT + sbu("k") + NONE + SETITEM + BUILD + STOP
    ),
    _h("build-ordereddict-dunder", "BUILD on an OrderedDict setting __class__")(
        lambda s, r: (
            P4
            + sglob("collections", "OrderedDict")
            + EMPTY_TUPLE
            + REDUCE
            + EMPTY_DICT
            + sbu("__class__")
            + sglob("torch", "Size")
            + SETITEM
            + BUILD
            + STOP
        )
    ),
    _h(
        "build-slotstate-class-swap",
        "Metadata NEWOBJ, BUILD (None, {'__class__': OrderedDict}) (setattr per slot item)",
    )(
        lambda s, r: (
            P4
            + sglob(_MD, "Metadata")
            + EMPTY_TUPLE
            + NEWOBJ
            + NONE
            + EMPTY_DICT
            + sbu("__class__")
            + sglob("collections", "OrderedDict")
            + SETITEM
            + TUPLE2
            + BUILD
            + STOP
        )
    ),
    _h("build-enum-member", "BUILD on a process-wide Enum member (_MEM_FORMAT_ENCODING(0)._value_ = 99)")(
        lambda s, r: (
            P4
            + call(sglob(_MD, "_MEM_FORMAT_ENCODING"), binint(0))
            + EMPTY_DICT
            + sbu("_value_")
            + binint(99)
            + SETITEM
            + BUILD
            + STOP
        )
    ),
    _h("newobj-non-admitted-type", "NEWOBJ of torch.Size (admitted as a callable, not as a class)")(
        lambda s, r: P4 + sglob("torch", "Size") + EMPTY_TUPLE + NEWOBJ + STOP
    ),
    _h("reduce-admitted-class", "REDUCE of an admitted class: Metadata({...}) runs its __init__")(
        lambda s, r: P4 + call(sglob(_MD, "Metadata"), EMPTY_DICT) + STOP
    ),
    _h("reduce-enum-functional-api", "_MEM_FORMAT_ENCODING('Evil', 'A B') builds a new Enum class")(
        lambda s, r: P4 + call(sglob(_MD, "_MEM_FORMAT_ENCODING"), sbu("Evil"), sbu("A B")) + STOP
    ),
    _h("reduce-admitted-callable-wrong-types", "torch.Size('abc'), pathlib.PosixPath(b'/')")(
        lambda s, r: (
            P4
            + MARK
            + call(sglob("torch", "Size"), sbu("abc"))
            + call(sglob("pathlib", "PosixPath"), binbytes(b"/"))
            + TUPLE
            + STOP
        )
    ),
    _h("deep-dicts", "a 100k-deep chain of dicts, no MARK")(
        lambda s, r: P4 + EMPTY_DICT + (NONE + EMPTY_DICT) * 100_000 + SETITEM * 100_000 + STOP
    ),
    _h("persid-text", "text PERSID (protocol 0)")(lambda s, r: b"Pstorage\n" + STOP),
    _h("binpersid-string", "BINPERSID with a bare string id")(lambda s, r: P4 + sbu("storage") + BINPERSID + STOP),
    _h("binpersid-path-key", "BINPERSID with a storage key that is a path")(
        lambda s, r: P4 + _rebuild(_storage_pid(key="../../etc/passwd"), MARK + binint(1) + TUPLE) + STOP
    ),
    _h("binpersid-negative-numel", "BINPERSID with a negative element count")(
        lambda s, r: P4 + _rebuild(_storage_pid(numel=-1), MARK + binint(1) + TUPLE) + STOP
    ),
    _h("binpersid-foreign-type", "BINPERSID whose storage type is os.system")(
        lambda s, r: (
            P4
            + MARK
            + sbu("storage")
            + sglob("os", "system")
            + sbu("0")
            + sbu("cpu")
            + binint(1)
            + TUPLE
            + BINPERSID
            + STOP
        )
    ),
    _h("oversized-binbytes8", "BINBYTES8 declaring 2**62 bytes")(
        lambda s, r: P4 + b"\x8e" + struct.pack("<Q", 1 << 62) + b"xx" + STOP
    ),
    _h("oversized-binunicode8", "BINUNICODE8 declaring 2**40 bytes")(
        lambda s, r: P4 + b"\x8d" + struct.pack("<Q", 1 << 40) + b"xx" + STOP
    ),
    _h("oversized-long4", "LONG4 declaring 2**31-1 bytes")(
        lambda s, r: P2 + b"\x8b" + struct.pack("<i", 2**31 - 1) + b"x" + STOP
    ),
    _h("oversized-frame", "FRAME declaring 2**60 bytes")(
        lambda s, r: P4 + b"\x95" + struct.pack("<Q", 1 << 60) + NONE + STOP
    ),
    _h("oversized-bytearray8", "BYTEARRAY8 declaring 2**50 bytes (protocol 5)")(
        lambda s, r: P5 + b"\x96" + struct.pack("<Q", 1 << 50) + STOP
    ),
    _h("out-of-band-buffer", "NEXT_BUFFER without buffers (protocol 5)")(lambda s, r: P5 + b"\x97" + STOP),
    _h("deep-marks", "100k nested MARKs")(lambda s, r: P4 + MARK * 100_000 + TUPLE * 100_000 + STOP),
    _h("deep-tuple1-chain", "a 200k-deep chain of 1-tuples")(lambda s, r: P4 + NONE + TUPLE1 * 200_000 + STOP),
    _h("deep-lists", "a 100k-deep chain of lists, no MARK")(lambda s, r: P4 + _nested_lists(100_000) + STOP),
    _h("self-reference", "a list that contains itself")(
        lambda s, r: P4 + EMPTY_LIST + MEMOIZE + b"h\x00" + APPEND + STOP
    ),
    _h("bad-opcode", "an opcode byte that does not exist")(lambda s, r: P4 + b"\xff" + STOP),
    _h("truncated-metadata", "the genuine metadata cut in half")(lambda s, r: r[: len(r) // 2]),
    _h("truncated-empty", "an empty pickle")(lambda s, r: b""),
    _h("truncated-proto-only", "PROTO and nothing else")(lambda s, r: P4),
    _h("payload-pop-then-metadata", "os.system(cmd), POP, then the genuine Metadata")(
        lambda s, r: P4 + os_system(s) + POP + _body(r) + STOP
    ),
    _h("payload-in-popped-mark-then-metadata", "the payload inside a MARK that POP_MARK discards")(
        lambda s, r: P4 + MARK + os_system(s) + POP_MARK + _body(r) + STOP
    ),
    _h("dag-dict-key", "a dict key of 60 levels of (x, x) tuples sharing one memo entry: ~2**60 steps to hash")(
        lambda s, r: P4 + EMPTY_DICT + _dag(60) + NONE + SETITEM + STOP
    ),
    _h("dag-frozenset", "FROZENSET of the same 60-level tuple DAG")(lambda s, r: P4 + MARK + _dag(60) + b"\x91" + STOP),
    _h("ordereddict-build-items", "BUILD on an OrderedDict shadowing its items() (the walk would see nothing)")(
        lambda s, r: (
            P4
            + call(sglob("collections", "OrderedDict"))
            + EMPTY_DICT
            + sbu("items")
            + sglob("collections", "OrderedDict")
            + SETITEM
            + BUILD
            + STOP
        )
    ),
    _h("dag-value", "the 60-level tuple DAG as a dict value (hashed later by whoever reads the field)")(
        lambda s, r: P4 + EMPTY_DICT + sbu("k") + _dag(60) + SETITEM + STOP
    ),
    _h("build-twice", "BUILD of the same object twice (a dict key changed after it was hashed)")(
        lambda s, r: (
            P4
            + call(sglob("collections", "OrderedDict"))
            + EMPTY_DICT
            + sbu("_metadata")
            + EMPTY_DICT
            + SETITEM
            + BUILD
            + EMPTY_DICT
            + sbu("_metadata")
            + EMPTY_DICT
            + SETITEM
            + BUILD
            + STOP
        )
    ),
    _h("ordereddict-of-a-dict", "OrderedDict(d): every key of d hashed again, none of them checked")(
        lambda s, r: P4 + call(sglob("collections", "OrderedDict"), EMPTY_DICT) + STOP
    ),
    _h("payload-tuple-getitem-metadata", "(payload, Metadata)[-1] through builtins.getattr")(
        lambda s, r: (
            P4
            + call(
                call(sglob("builtins", "getattr"), MARK + os_system(s) + _body(r) + TUPLE, sbu("__getitem__")),
                binint(-1),
            )
            + STOP
        )
    ),
]


def _dag(depth: int) -> bytes:
    """x0 = (0,); x(i+1) = (x(i), x(i)), each level memoized once: ``depth`` levels in 5 bytes each."""
    out = binint(0) + TUPLE1 + MEMOIZE
    for i in range(depth):
        get = b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)
        out += POP + get + get + TUPLE2 + MEMOIZE  # the level below leaves the stack: only the memo holds it
    return out


def _nested_lists(depth: int) -> bytes:
    """[[[...]]] built with EMPTY_LIST / APPEND only (no MARK), ``depth`` levels under the outer list."""
    return EMPTY_LIST * depth + APPEND * (depth - 1)


_EXTENSIONS = {("os", "system"): EXT_CODE1, ("posix", "system"): EXT_CODE, ("subprocess", "getoutput"): EXT_CODE4}


def register_extensions() -> Callable[[], None]:
    """Register os.system in copyreg's extension registry, and put it in the extension cache under a code that
    is not registered (as an attacker would hope a process has); returns the undo."""
    import os

    for (module, name), code in _EXTENSIONS.items():
        copyreg.add_extension(module, name, code)
    copyreg._extension_cache[EXT_CODE_CACHED] = os.system  # type: ignore[attr-defined]

    def undo() -> None:
        for (module, name), code in _EXTENSIONS.items():
            copyreg.remove_extension(module, name, code)
        copyreg._extension_cache.pop(EXT_CODE_CACHED, None)  # type: ignore[attr-defined]

    return undo


# ------------------------------------------------------------------------------------ planting
def torch_record(data_pkl: bytes, storage: bytes = b"\x00" * 16) -> bytes:
    """A torch.save-shaped zip record: archive/data.pkl (hostile), byteorder, one storage."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/data/0", storage)
        zf.writestr("archive/version", b"3\n")
    return buf.getvalue()


def rehash(ckpt_dir: Path) -> None:
    """Refresh sizes and xxh3 checksums in manifest.json after a file was replaced on purpose."""
    mpath = ckpt_dir / "manifest.json"
    raw = json.loads(mpath.read_text())
    for entry in raw["files"]:
        entry["size"], entry["xxh3_128"] = hash_file(ckpt_dir / entry["path"])
    mpath.write_text(json.dumps(raw))


def plant_metadata(ckpt_dir: Path, data: bytes) -> Path:
    (ckpt_dir / ".metadata").write_bytes(data)
    rehash(ckpt_dir)
    return ckpt_dir / ".metadata"


def plant_dcp_record(ckpt_dir: Path, fqn: str, record: bytes) -> Path:
    """Append ``record`` to the .distcp file holding ``fqn``'s first record and point the metadata at it
    (the genuine metadata, re-pickled by the genuine pickler); manifest refreshed for both files."""
    from ckpt.formats.dcp.reader import read_metadata

    md = read_metadata(ckpt_dir)
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    path = ckpt_dir / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(record)
    info.offset, info.length = offset, len(record)
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    rehash(ckpt_dir)
    return path


def plant_pt(path: Path, data_pkl: bytes) -> Path:
    path.write_bytes(torch_record(data_pkl))
    rehash(path.parent)
    return path


__all__ = [
    "CORPUS",
    "LIVE",
    "Hostile",
    "plant_dcp_record",
    "plant_metadata",
    "plant_pt",
    "register_extensions",
    "rehash",
    "torch_record",
]


# The entries that run their payload synchronously under the standard unpickler (pickle.loads), with
# the extension registry filled: the corpus is live, so a test that finds no sentinel proves a refusal.
LIVE = frozenset(
    {
        "dotted-dcp-filesystem-os.system",
        "dotted-dcp-metadata-os.system",
        "dotted-torch-os.system",
        "dotted-serialization-pickle.loads",
        "global-os.system-proto0",
        "global-os.system-proto2",
        "stack-global-os.system-proto5",
        "posix.system",
        "inst-os.system",
        "obj-os.system",
        "builtins.eval",
        "builtins.exec",
        "builtins.getattr+__import__",
        "builtins.__import__-proto2",
        "functools.partial",
        "pickle.loads",
        "metadata-build-setstate-os.system",
        "ext1",
        "ext2",
        "ext4",
        "ext2-cache-only",
        "payload-pop-then-metadata",
        "payload-in-popped-mark-then-metadata",
        "payload-tuple-getitem-metadata",
    }
)

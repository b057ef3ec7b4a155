"""Every format module of `formats.FORMAT_MODULES` keeps the one contract (`formats.FormatModule`, and
`EditableFormatModule` where it has `training_state`): the members the registry and the operations call, with the
parameter names they call them by, a FORMAT id unique across the modules, a documented `open`; and the registry's
lookup by name refuses an unknown name with an error that names the known ones."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from ckpt_tools import formats
from ckpt_tools.errors import CkptError
from ckpt_tools.formats import EditableFormatModule, FormatModule, format_module
from ckpt_tools.formats._protocol import UniversalSourceModule


def _params(fn) -> list[str]:
    """The names of `fn`'s positional parameters (keyword-only ones with defaults are extensions, allowed)."""
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        assert p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is not inspect.Parameter.empty, (fn, p)
    return [p.name for p in sig.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("name", formats.FORMAT_MODULES)
def test_every_format_module_satisfies_the_protocol(name):
    mod = format_module(name)
    assert isinstance(mod, FormatModule)
    assert isinstance(mod.FORMAT, str) and mod.FORMAT
    assert callable(mod.sniff) and _params(mod.sniff) == ["path"]
    assert callable(mod.open) and _params(mod.open) == ["path"]
    doc = inspect.getdoc(mod.open)
    assert doc and len(doc) > 80, f"{name}.open says what it reads"
    if hasattr(mod, "training_state"):
        assert isinstance(mod, EditableFormatModule)
        assert callable(mod.training_state) and _params(mod.training_state) == ["ck"]
    else:
        assert not isinstance(mod, EditableFormatModule)


def test_the_format_ids_are_unique_and_the_editable_ones_are_those_with_training_state():
    ids = formats.format_ids()
    assert len(ids) == len(set(ids)) == len(formats.FORMAT_MODULES)
    editable = {format_module(n).FORMAT for n in formats.FORMAT_MODULES if hasattr(format_module(n), "training_state")}
    assert set(formats.editable_format_ids()) == editable
    assert {"deepspeed_zero", "dcp", "megatron_legacy", "megatron_torch_dist"} <= editable


def test_the_modules_to_universal_converts_say_so_by_their_hook():
    """`ckpt to-universal` asks a format module for its source (`universal_source`), never which module it is:
    exactly the formats holding a DeepSpeed tag folder have the hook, with the interface's parameters."""
    hooked = {n for n in formats.FORMAT_MODULES if isinstance(format_module(n), UniversalSourceModule)}
    assert hooked == {"deepspeed", "deepspeed_moe", "megatron_pipeline", "accelerate", "hf_trainer"}
    for n in hooked:
        hook = format_module(n).universal_source
        assert list(inspect.signature(hook).parameters) == ["path", "tp_patterns"], n
        assert inspect.getdoc(hook), n


def test_the_protocol_members_each_say_their_contract():
    for proto, members in (
        (FormatModule, ("sniff", "open")),
        (EditableFormatModule, ("training_state",)),
        (UniversalSourceModule, ("universal_source",)),
    ):
        for m in members:
            assert inspect.getdoc(getattr(proto, m)), (proto, m)


def test_an_unknown_format_name_is_a_clear_error_naming_the_known_ones():
    with pytest.raises(CkptError) as err:
        format_module("no_such_format")
    assert isinstance(err.value, KeyError)
    text = str(err.value)
    assert "no_such_format" in text
    assert all(n in text for n in formats.FORMAT_MODULES)
    # a helper module of the package is not a format, even though it imports
    with pytest.raises(KeyError):
        format_module("_common")


def test_the_registry_is_torch_free_at_import():
    """The format modules import no torch or numpy: `ckpt inspect` reads checkpoints without them."""
    code = (
        "import sys; from ckpt_tools import formats; [formats.format_module(n) for n in formats.FORMAT_MODULES]; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

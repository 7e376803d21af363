"""Each op is declared once (csrc/ops.cpp, the op table) and everything else
follows from it: the schemas, the eager entry points, the fakes, the
methods' reading of outputs by name. CommConfig's fields are declared once
(CommConfig::each_field), and the transports register records of what they
can do (csrc/transport.h). No communicator is needed here."""
from __future__ import annotations

import inspect

import pytest
import torch

import rdna4_comm as rc
from rdna4_comm import _C, _ep_methods
from rdna4_comm.ops import OP_TABLE, output_getter
from rdna4_comm.results import DispatchHandle
from rdna4_comm.transport_policy import TRANSPORT_RECORDS, TRANSPORTS

KINDS = {"T": "Tensor", "O": "Optional[Tensor]", "f": "float"}


@pytest.mark.parametrize("name", sorted(OP_TABLE))
def test_the_schema_eager_entry_and_fake_come_from_the_declaration(name):
    decl = OP_TABLE[name]
    schema = getattr(torch.ops.rdna4_comm, name).default._schema
    args = [(a.name, str(a.type)) for a in schema.arguments]
    assert args == [(n, KINDS[k]) for n, k in decl["args"]] + [("order", "Tensor"), ("comm", "str")]
    assert schema.arguments[-2].alias_info.is_write  # the ordering token (rdna4_comm.ops)
    returns = [r.name for r in schema.returns]
    assert returns == (decl["outputs"] if len(decl["outputs"]) > 1 else [""])
    assert callable(getattr(_C.eager, name))
    assert torch._library.simple_registry.singleton.find(f"rdna4_comm::{name}").fake_impl.kernel is not None


def test_every_output_of_the_dispatch_ops_is_read_by_name():
    """dispatch reads every output of its ops: a new output fails here
    until the methods expose it (or decide not to)."""
    for op, read in _ep_methods._READ.items():
        assert sorted(read) == sorted(OP_TABLE[op]["outputs"])
        assert OP_TABLE[op + "_fp8"]["outputs"] == OP_TABLE[op]["outputs"] + ["x_scales"]


def test_the_handle_is_the_combine_ops_arguments():
    """What combine takes back (after y) are dispatch outputs of those names,
    and DispatchHandle holds each."""
    for dispatch, combine in (("dispatch", "combine"), ("dispatch_expert", "combine_expert")):
        handle = [n for n, _ in OP_TABLE[combine]["args"][1:]]
        assert set(handle) <= set(OP_TABLE[dispatch]["outputs"]), combine
        assert set(handle) <= set(DispatchHandle._fields), combine


def test_output_getter_picks_by_name_and_rejects_unknown_names():
    get = output_getter("dispatch", "send_mask", "x")
    outputs = OP_TABLE["dispatch"]["outputs"]
    assert get(tuple(outputs)) == ["send_mask", "x"]
    with pytest.raises(ValueError, match=r"dispatch has no output \['y'\]"):
        output_getter("dispatch", "x", "y")
    # Every output in the op's own order: the tuple itself, no copy per call.
    for op, decl in OP_TABLE.items():
        out = tuple(decl["outputs"])
        assert output_getter(op, *out)(out) is out


def test_config_fields_give_the_keywords_attributes_properties_and_agreement():
    fields = _C.CommConfig.fields
    names = [f["name"] for f in fields]
    assert len(set(names)) == len(names)
    ctor = inspect.signature(rc.Communicator.__init__).parameters
    for f in fields:
        assert isinstance(getattr(_C.CommConfig, f["name"]), property), f
        if f["argument"]:
            assert f["argument"] in ctor, f
        if f["doc"]:
            prop = getattr(rc.Communicator, f["argument"])
            assert isinstance(prop, property) and prop.__doc__ == f["doc"], f
        if f["agreed"]:
            assert f["argument"], f  # agreement is over what the ranks pass
    with pytest.raises(TypeError, match="missing keyword"):
        _C.CommConfig(id="x")
    every = {f["name"]: 0 for f in fields} | dict(id="x", transport="cpu", group_name="", dtype=torch.float32,
                                                   dispatch_dtype=None, dist_check_calls=False)
    config = _C.CommConfig(**every)
    assert config.dispatch_dtype is None and config.dtype == torch.float32
    with pytest.raises(TypeError, match="unknown keywords"):
        _C.CommConfig(**every, colour="blue")


def test_transport_records():
    assert TRANSPORTS == ("auto", *sorted(TRANSPORT_RECORDS)) and set(TRANSPORT_RECORDS) == {"cpu", "dist", "gpu"}
    assert TRANSPORT_RECORDS["gpu"].built == _C.with_gpu
    for name, t in TRANSPORT_RECORDS.items():
        assert t.name == name
        assert _C.allreduce_slot_bytes(name, 0) == t.default_slot_bytes
        assert rc.allreduce_algorithm(t.one_shot_max_bytes, 4, name) == "one_shot"
        assert rc.allreduce_algorithm(t.one_shot_max_bytes + 1, 4, name) == "two_shot"
        assert _C.testing.one_shot_max_bytes[name] == t.one_shot_max_bytes
        assert t.max_world <= _C.max_world
    # Only the GPU transport runs the library's kernels and crosses device links.
    assert [n for n, t in TRANSPORT_RECORDS.items() if t.device_kernels] == ["gpu"]
    assert [n for n, t in TRANSPORT_RECORDS.items() if t.writes_cross_links] == ["gpu"]
    assert [n for n, t in TRANSPORT_RECORDS.items() if t.process_group] == ["dist"]
    assert not TRANSPORT_RECORDS["cpu"].device_tensors and not TRANSPORT_RECORDS["cpu"].graph_capture
    with pytest.raises(ValueError, match=r"no transport named 'nvlink' \(there are 'cpu', 'dist', 'gpu'\)"):
        _C.allreduce_slot_bytes("nvlink", 0)


def test_the_docs_table_of_transports_is_their_records():
    """docs/transports.md, "What each transport can do", row by row."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "transports.md").read_text()
    names = sorted(TRANSPORT_RECORDS)

    def shown(attr, name):
        v = getattr(TRANSPORT_RECORDS[name], attr)
        if attr == "built":
            return "GPU builds" if name == "gpu" else "yes"
        if isinstance(v, bool):
            return "yes" if v else "no"
        if attr == "max_tokens_per_rank" and v > 1 << 40:
            return "no limit"
        if attr.endswith("_bytes"):
            return f"{v >> 20} MiB" if v >= 1 << 20 else f"{v >> 10} KiB"
        return str(v)

    rows = re.findall(r"^\| [^|]* \(`(\w+)`\) \| (.*) \|$", text, re.M)
    assert {attr for attr, _ in rows} == {a for a in dir(_C.Transport) if not a.startswith("_")} - {"name"}
    for attr, cells in rows:
        assert [c.strip() for c in cells.split("|")] == [shown(attr, n) for n in names], attr


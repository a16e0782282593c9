"""``RecordedLaunch``'s launch past Triton's launcher object (``_runtime.raw_launcher``), without a GPU.

A replayed launch whose arguments include tensor descriptors calls the C launch function from the compiled
launcher's closure with each descriptor encoded once per tuple of base addresses and spliced in at its place; a
new base address encodes again; launch hooks, another device or a launcher of another shape take the launcher
object as before. Fake kernels and a fake encoder stand in for Triton 3.6's (the H200 runs the real ones:
``tests/test_mla_context_gluon.py::test_gpu_context_raw_launch``).
"""

from __future__ import annotations

import pytest
import torch
import triton

import kvforge.kernels._runtime as rt


class _Desc:
    """Stands in for a host tensor descriptor: fields plus ``base``."""

    def __init__(self, base: torch.Tensor, block: list[int]) -> None:
        self.base, self.block_shape, self.shape = base, block, list(base.shape)


def _kernel(calls: list, scratch: int = 0, metas: int = 2):
    def launch(*args):  # the C launch function
        calls.append(("raw", args))

    def wrapper(*args):  # the descriptor wrapper: the C function in its closure
        return launch(*args)

    class Launcher:
        global_scratch_size, profile_scratch_size = scratch, 0
        launch_cooperative_grid, launch_pdl = False, False

        def __call__(self, *args):
            calls.append(("object", args))

    Launcher.launch = staticmethod(wrapper)
    meta = type("M", (), {"tensordesc_meta": [{"m": i} for i in range(metas)]})()
    return type("K", (), {"run": Launcher(), "metadata": meta, "function": 11, "packed_metadata": 12})()


@pytest.fixture
def checked_triton(monkeypatch):
    monkeypatch.setattr(rt, "RAW_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(rt, "RAW_LAUNCH", True)
    monkeypatch.setattr(rt, "_hooks_active", lambda: False)


def _recording(calls: list, encoded: list, **kw) -> rt.RecordedLaunch:
    kernel = _kernel(calls, **kw)
    fast = (kernel, (42,), "dev", lambda: "dev", lambda device: "stream")
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    args = [a, _Desc(b, [2]), 7, _Desc(c, [4])]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rt, "jit_direct", lambda *x, **y: fast)
        rec = rt.RecordedLaunch.record(object(), (3,), args, {"C": 1}, {}, (a, b, c))
    assert rec is not None
    if rec.raw is not None:

        def encode(desc, meta):
            encoded.append(desc.base.data_ptr())
            return ["map", desc.base.data_ptr(), meta["m"], *desc.block_shape]

        rec.raw = (*rec.raw[:4], encode)
    return rec


def test_replay_splices_descriptors_encoded_once_per_address(checked_triton):
    calls, encoded = [], []
    rec = _recording(calls, encoded)
    assert rec.raw is not None
    t = (torch.ones(4), torch.ones(4), torch.ones(4))
    rec.launch(t)
    rec.launch(t)
    assert [kind for kind, _ in calls] == ["raw", "raw"] and calls[0] == calls[1]
    args = calls[0][1]
    assert args[:13] == (3, 1, 1, "stream", 11, False, False, None, None, 12, None, None, None)
    p1, p2 = t[1].data_ptr(), t[2].data_ptr()
    assert args[13] is t[0] and args[14:] == ("map", p1, 0, 2, 7, "map", p2, 1, 4, 42)
    assert encoded == [p1, p2]  # the second launch reused the encoding
    other = (t[0], t[1], torch.ones(4))
    rec.launch(other)
    assert calls[-1][1][-5:-1] == ("map", other[2].data_ptr(), 1, 4) and len(encoded) == 4


def test_replay_takes_the_launcher_object_otherwise(checked_triton, monkeypatch):
    calls, encoded = [], []
    for kw in ({"scratch": 64}, {"metas": 3}):  # another launcher shape: no raw entry
        rec = _recording(calls, encoded, **kw)
        assert rec.raw is None
        rec.launch((torch.ones(4), torch.ones(4), torch.ones(4)))
        assert calls[-1][0] == "object"
    rec = _recording(calls, encoded)
    monkeypatch.setattr(rt, "_hooks_active", lambda: True)  # a launch hook: Triton's own path
    monkeypatch.setattr(rt, "launch_jit", lambda *a, **kw: calls.append(("jit", a)))
    rec.launch((torch.ones(4), torch.ones(4), torch.ones(4)))
    assert calls[-1][0] == "jit" and encoded == []
    monkeypatch.setattr(rt, "RAW_VERSIONS", ("0.0.",))
    assert _recording(calls, encoded).raw is None
    monkeypatch.setattr(rt, "RAW_VERSIONS", (triton.__version__,))
    monkeypatch.setattr(rt, "RAW_LAUNCH", False)
    assert _recording(calls, encoded).raw is None

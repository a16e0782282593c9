"""Bounded failures between real processes (gloo): a peer killed mid-transfer, a silent peer, a late message,
cancellation and a sender-side timeout; each ends in a clear error, releases its pages, and a retry succeeds.

World: rank 0 is a generation instance "G"; ranks 1 and 2 a context instance "A" with two PP stages; rank 3 a
context instance "B". The steps run in order, separated by barriers of the ranks still alive.
"""

from __future__ import annotations

import os
import time

import pytest

from kvforge.disagg import synthetic as syn
from kvforge.disagg.launch import run_world

MODEL = syn.ModelSpec(num_layers=2, head_dim=8, tokens_per_block=4)
G = syn.InstanceSpec("G", (0,))
A = syn.InstanceSpec("A", (1, 2), pp=2)
B = syn.InstanceSpec("B", (3,))
TOKENS = 13  # 4 blocks
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def drain_orphans(ep, timeout_s: float = 10.0) -> None:
    """Poll until the orphaned receives end (bounded). The sender saw its send complete; the receiving side
    learns it from gloo's wait thread a moment later, so one poll right after a barrier may be too early."""
    deadline = time.monotonic() + timeout_s
    ep.check_status()
    while ep.orphans and time.monotonic() < deadline:
        time.sleep(0.01)
        ep.check_status()


def fault_world(rank: int, world: int, seed: int, post_async: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from kvforge.disagg.transceiver import KVReceiver, KVSender
    from kvforge.disagg.transport import TorchDistTransport

    t = TorchDistTransport()
    survivors = dist.new_group([0, 1, 3])
    a_group = dist.new_group([1, 2])
    cpu = torch.device("cpu")
    nb = -(-TOKENS // MODEL.tokens_per_block)
    out: dict = {}

    def sync() -> None:
        dist.barrier(group=survivors)

    if rank == 0:
        layers = syn.make_layers(MODEL, G, 0, cpu)
        alloc = syn.PageAllocator(MODEL.total_groups, G.num_pages, seed)
        ep = KVReceiver(t, syn.make_rank_info(MODEL, G, 0), layers, release=alloc.release, timeout_s=20)
        ep.connect("A", A.ranks)
        ep.connect("B", B.ranks)
    else:
        inst = A if rank in A.ranks else B
        ir = inst.ranks.index(rank)
        layers = syn.make_layers(MODEL, inst, ir, cpu)
        alloc = syn.PageAllocator(MODEL.total_groups, inst.num_pages, seed + rank)
        ep = KVSender(
            t, syn.make_rank_info(MODEL, inst, ir), layers, release=alloc.release, timeout_s=20, post_async=post_async
        )
        ep.connect("G", G.ranks)
    dist.barrier()

    def gen_request(tid: int, peer: str, **kw):
        req = alloc.alloc(tid, TOKENS, [nb] * MODEL.total_groups)
        ep.request(tid, req, peer, **kw)
        return req

    def ctx_send(tid: int, fill_seed: int = seed, **kw):
        req = alloc.alloc(tid, TOKENS, [nb] * MODEL.total_groups)
        syn.fill_context(MODEL, layers, req, fill_seed, 0)
        ep.send(tid, req, "G", **kw)
        return ep.wait()

    def verify(req) -> list[str]:
        report = syn.CheckReport()
        syn.check_generation(MODEL, G, 0, layers, req, seed, expect_draft=True, report=report)
        assert report.blocks_checked == {"target": MODEL.num_layers * nb, "draft": nb}
        return report.problems

    # 1. A's second stage dies after its first stage's message is on the way.
    if rank == 0:
        gen_request(1, "A")
        st = ep.check_status(blocking=True)
        out["killed"] = dict(st.failed)
        out["killed_completed"] = list(st.completed)
        out["leaked_after_kill"] = alloc.leaked
    elif rank == 1:
        out["a1"] = ctx_send(1).completed
        dist.barrier(group=a_group)
    elif rank == 2:
        req = alloc.alloc(1, TOKENS, [nb] * MODEL.total_groups)
        syn.fill_context(MODEL, layers, req, seed, 0)
        dist.barrier(group=a_group)
        os._exit(1)  # killed before sending its stage's layers
    sync()

    # 2. The request is retried from instance B.
    if rank == 0:
        req2 = gen_request(2, "B")
        st = ep.check_status(blocking=True)
        out["retry_after_kill"] = (st.completed, dict(st.failed), verify(req2))
    elif rank == 3:
        out["b2"] = ctx_send(2).completed
    sync()

    # 3. B stays silent for transfer 3: the receiver gives up at its deadline.
    if rank == 0:
        req3 = gen_request(3, "B", timeout_s=1.5)
        st = ep.check_status(blocking=True)
        out["silent"] = (st.completed, dict(st.failed), len(ep.orphans))
    sync()

    # 4. Retry from the same peer under a new id.
    if rank == 0:
        req4 = gen_request(4, "B")
        st = ep.check_status(blocking=True)
        out["retry_after_silence"] = (st.completed, dict(st.failed), verify(req4))
        out["reused_pages"] = [set(a) == set(b) for a, b in zip(req3.page_indices, req4.page_indices)]
    elif rank == 3:
        out["b4"] = ctx_send(4).completed
    sync()

    # 5. B finally sends transfer 3 (other contents): it lands in the receiver's orphaned buffer, not in the pages
    #    that transfer 3 gave back (transfer 4 may hold them now).
    if rank == 3:
        out["b3_late"] = ctx_send(3, fill_seed=seed + 1).completed
    sync()
    if rank == 0:
        drain_orphans(ep)
        out["after_late"] = (len(ep.orphans), verify(req4), verify(req2))
    sync()

    # 6. Cancellation before the data arrives; the sender's message then drains into the orphaned buffer.
    if rank == 0:
        gen_request(6, "B")
        ep.cancel(6)
        st = ep.check_status()
        out["cancelled"] = (st.completed, dict(st.failed))
    sync()
    if rank == 3:
        out["b6"] = ctx_send(6).completed
    sync()
    if rank == 0:
        drain_orphans(ep)
        out["orphans_after_cancel"] = len(ep.orphans)

    # 7. The generation side never asks for transfer 7: the sender gives up at its deadline.
    if rank == 3:
        st = ctx_send(7, timeout_s=1.0)
        out["sender_timeout"] = (st.completed, dict(st.failed))
    sync()

    if rank == 0:
        alloc.release(req2)
        alloc.release(req4)
    out["leaked"] = alloc.leaked
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("post_async", [False, True], ids=["post-inline", "post-thread"])
def test_faults_end_in_clear_errors_without_leaks_and_retries_succeed(post_async):
    seed = int.from_bytes(os.urandom(3), "little")
    res = run_world(fault_world, 4, args=(seed, post_async), timeout_s=140, env_overrides=CPU_ONLY)
    assert res[2].exitcode == 1 and res[2].value is None, "rank 2 was meant to die"
    for r in (0, 1, 3):
        assert res[r].reported, f"rank {r} (seed {seed}): exit {res[r].exitcode}\n{res[r].error}"
    g, a1, b = res[0].value, res[1].value, res[3].value

    # 1. Killed peer: a clear error naming the dead rank, after one of the two messages arrived.
    assert g["killed_completed"] == [] and list(g["killed"]) == [1]
    reason = g["killed"][1]
    assert "from rank 2 failed" in reason and "1 of 2 messages done" in reason, reason
    assert "timed out" not in reason, "the dead peer should be detected before the deadline"
    assert g["leaked_after_kill"] == 0
    assert a1["a1"] == [1]
    # 2. Retry elsewhere.
    assert g["retry_after_kill"] == ([2], {}, [])
    assert b["b2"] == [2]
    # 3. Silent peer.
    completed, failed, orphans = g["silent"]
    assert completed == [] and list(failed) == [3] and orphans == 1
    assert "timed out after 1.5 s waiting for context rank(s) [3] of 'B' (0 of 1 messages done)" in failed[3]
    # 4. Retry from the same peer.
    assert g["retry_after_silence"] == ([4], {}, [])
    assert b["b4"] == [4]
    # 5. The late message drained the orphan and corrupted nothing, although transfer 4 reuses 3's pages.
    assert all(g["reused_pages"])
    assert b["b3_late"] == [3]
    assert g["after_late"] == (0, [], [])
    # 6. Cancellation.
    assert g["cancelled"] == ([], {6: "cancelled"})
    assert b["b6"] == [6] and g["orphans_after_cancel"] == 0
    # 7. Sender-side deadline.
    completed, failed = b["sender_timeout"]
    assert completed == [] and "timed out after 1 s waiting for generation rank(s) [0] of 'G'" in failed[7]
    # No pages leaked anywhere.
    assert (g["leaked"], a1["leaked"], b["leaked"]) == (0, 0, 0)

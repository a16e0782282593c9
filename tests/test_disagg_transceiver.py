"""Transceiver logic over an in-process transport (one thread per rank): cheap, deterministic, exhaustive.

The real transport (torch.distributed over gloo, one process per rank) is exercised in test_disagg_transfer.py
and test_disagg_faults.py; here the same classes run over a matching in-memory transport so that every
validation, the consensus, the idle probe's branch choice, cancellation and the failure paths are covered
without process start-up costs.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.disagg import synthetic as syn
from kvforge.disagg.layers import RequestKV
from kvforge.disagg.transceiver import HEADER_BYTES, KVReceiver, KVSender
from kvforge.disagg.transport import Group, Handle, Transport
from kvforge.errors import TransferError
from kvforge.kernels._runtime import kernel_device
from kvforge.kernels.kv_pack import KVPackPlan

_INTERPRETER_LOCK = threading.Lock()
POST_ASYNC = [False]


@pytest.fixture(autouse=True, params=[False, True], ids=["post-inline", "post-thread"])
def _post_mode(request):
    """Every test runs with the sender posting its messages itself and from its posting thread (the NCCL
    default), which must not change any outcome."""
    POST_ASYNC[0] = request.param
    yield


@pytest.fixture(autouse=True)
def _one_kernel_at_a_time(monkeypatch):
    """Ranks here are threads of one process, and the Triton interpreter patches tl globally while it runs a
    kernel, so two threads must not interpret kernels at once (one process per rank, as in production, never
    shares the interpreter)."""
    launch = KVPackPlan._launch

    def locked(self, *args, **kwargs):
        with _INTERPRETER_LOCK:
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(KVPackPlan, "_launch", locked)


class _Flag(Handle):
    def __init__(self) -> None:
        self.ok = threading.Event()
        self.error: str | None = None

    def done(self) -> bool:
        if self.error:
            raise TransferError(self.error)
        return self.ok.is_set()


class FakeWorld:
    """Mailboxes matched by (src, dst, tag), like gloo; all-gathers through a barrier per group."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.sends: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self.recvs: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self.groups: dict[tuple[int, ...], dict] = {}

    def post(self, kind: str, buf: torch.Tensor, src: int, dst: int, tag: int) -> Handle:
        h = _Flag()
        key = (src, dst, tag)
        with self.lock:
            other = self.recvs if kind == "send" else self.sends
            mine = self.sends if kind == "send" else self.recvs
            if other[key]:
                obuf, oh = other[key].popleft()
                send_buf, recv_buf = (buf, obuf) if kind == "send" else (obuf, buf)
                if send_buf.numel() != recv_buf.numel():
                    oh.error = h.error = f"size mismatch {send_buf.numel()} vs {recv_buf.numel()}"
                else:
                    recv_buf.copy_(send_buf)
                    oh.ok.set()
                    h.ok.set()
            else:
                mine[key].append((buf, h))
        return h

    def pending(self) -> int:
        with self.lock:
            return sum(len(q) for q in self.sends.values()) + sum(len(q) for q in self.recvs.values())

    def gather(self, ranks: tuple[int, ...], rank: int, values: torch.Tensor) -> torch.Tensor:
        with self.lock:
            g = self.groups.setdefault(ranks, {"barrier": threading.Barrier(len(ranks)), "slots": {}})
        g["slots"][rank] = values.clone()
        g["barrier"].wait(timeout=20)
        out = torch.stack([g["slots"][r] for r in ranks])
        g["barrier"].wait(timeout=20)
        return out


class FakeTransport(Transport):
    supports_tags = True

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.size
        self.device = torch.device("cpu")
        self.gathers = 0

    def isend(self, buf, dst, tag):
        return self.world.post("send", buf, self.rank, dst, tag)

    def irecv(self, buf, src, tag):
        return self.world.post("recv", buf, src, self.rank, tag)

    def new_group(self, ranks):
        return Group(sorted(ranks))

    def all_gather_int64(self, values, group):
        self.gathers += 1
        return self.world.gather(group.ranks, self.rank, values)


def run_ranks(n: int, fn, timeout: float = 60.0) -> list:
    """Run fn(rank, world) on n threads; re-raise the first failure."""
    world = FakeWorld(n)
    results: list = [None] * n
    errors: list = []

    def body(r):
        try:
            results[r] = fn(r, world)
        except BaseException as exc:
            errors.append((r, exc))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0][1]
    return results


MODEL = syn.ModelSpec(num_layers=2, head_dim=8, tokens_per_block=4)
# Pools live where kernels run (the GPU when there is one); the in-memory transport moves host tensors, so on
# a GPU the transceiver's staging copies are exercised too.
POOLS = kernel_device()


def endpoints(world, rank, ctx, gen, *, timeout_s=5.0, connect=True):
    t = FakeTransport(world, rank)
    group = t.new_group(gen.ranks)
    if rank in ctx.ranks:
        ir = ctx.ranks.index(rank)
        layers = syn.make_layers(MODEL, ctx, ir, POOLS)
        alloc = syn.PageAllocator(MODEL.total_groups, ctx.num_pages, rank)
        ep = KVSender(
            t,
            syn.make_rank_info(MODEL, ctx, ir),
            layers,
            release=alloc.release,
            timeout_s=timeout_s,
            post_async=POST_ASYNC[0],
        )
        if connect:
            ep.connect(gen.name, gen.ranks)
    else:
        ir = gen.ranks.index(rank)
        layers = syn.make_layers(MODEL, gen, ir, POOLS)
        alloc = syn.PageAllocator(MODEL.total_groups, gen.num_pages, rank)
        size = gen.tp * gen.pp * gen.cp
        ep = KVReceiver(
            t,
            syn.make_rank_info(MODEL, gen, ir),
            layers,
            group=group if size > 1 else None,
            release=alloc.release,
            timeout_s=timeout_s,
        )
        if connect:
            ep.connect(ctx.name, ctx.ranks)
    return t, ep, layers, alloc, ir


def barrier(world, rank, ranks):
    world.gather(tuple(ranks), rank, torch.zeros(1, dtype=torch.int64))


def test_validation_happens_before_anything_is_posted():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1,))

    def body(rank, world):
        _, ep, _, alloc, _ = endpoints(world, rank, ctx, gen)
        barrier(world, rank, (0, 1))
        if rank == 1:
            return None
        good = alloc.alloc(0, 9, [3, 3, 3])
        bad_calls = [
            (ValueError, "peer: 'nobody' is not connected", lambda: ep.send(1, good, "nobody")),
            (ValueError, "transfer_id", lambda: ep.send(-1, good, "gen")),
            (ValueError, "transfer_id", lambda: ep.send(2**30, good, "gen")),
            (TypeError, "request", lambda: ep.send(1, "pages", "gen")),
            (
                ValueError,
                r"request\.page_indices\[1\]: expected 3 pages",
                lambda: ep.send(1, RequestKV(1, 9, ((1, 2, 3), (4,), (5, 6, 7))), "gen"),
            ),
            (
                ValueError,
                r"request\.page_indices\[0\]: pages must lie in \[0, 48\), got \[999\]",
                lambda: ep.send(1, RequestKV(1, 9, ((1, 2, 999), (4, 5, 6), (5, 6, 7))), "gen"),
            ),
            (ValueError, "timeout_s", lambda: ep.send(1, good, "gen", timeout_s=0)),
            (ValueError, "already connected", lambda: ep.connect("gen", (1,))),
        ]
        for exc, pattern, call in bad_calls:
            with pytest.raises(exc, match=pattern):
                call()
        assert world.pending() == 0 and not ep.sessions, "a rejected call left something posted"
        ep.send(1, good, "gen")
        with pytest.raises(ValueError, match="already in flight"):
            ep.send(1, good, "gen")
        ep.cancel(1)
        st = ep.poll()
        assert st.failed == {1: "cancelled"} and alloc.leaked == 0
        return True

    assert run_ranks(2, body)[0]


def test_receiver_rejects_duplicate_destination_pages_and_wrong_shard_sizes():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1, 2), cp=2)

    def body(rank, world):
        _, ep, _, _, ir = endpoints(world, rank, ctx, gen)
        if rank == 0:
            return None
        # 9 tokens = 3 blocks: cp rank 0 holds 2, cp rank 1 holds 1.
        n = 2 if ir == 0 else 1
        with pytest.raises(ValueError, match=rf"expected {n} pages"):
            ep.request(1, RequestKV(1, 9, ((0, 1, 2),) * 3), "ctx")
        if ir == 0:
            with pytest.raises(ValueError, match=r"request\.page_indices\[0\]: page\(s\) \[4\] appear more than once"):
                ep.request(1, RequestKV(1, 9, ((4, 4),) * 3), "ctx")
        assert not ep.sessions
        return True

    run_ranks(3, body)


def test_malformed_message_fails_the_transfer_and_releases_pages():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1,))

    def body(rank, world):
        t, ep, _, alloc, _ = endpoints(world, rank, ctx, gen)
        if rank == 1:
            req = alloc.alloc(3, 8, [2, 2, 2])
            ep.request(3, req, "ctx")
            barrier(world, rank, (0, 1))
            st = ep.check_status(blocking=True)
            assert 3 in st.failed and "malformed message" in st.failed[3], st.failed
            assert alloc.leaked == 0
            return st.failed[3]
        barrier(world, rank, (0, 1))
        # A rogue message of the right size but a header naming another transfer.
        n = ep.peers["gen"].pieces[0]
        plan = ep._piece_plan("gen", 0, n, alloc.alloc(3, 8, [2, 2, 2]), [0, 1], unpack=False)
        buf = torch.zeros(HEADER_BYTES + plan.nbytes, dtype=torch.uint8)
        buf[:HEADER_BYTES].view(torch.int64)[:] = torch.tensor([1, 2, 3, 4])
        t.isend(buf, 1, 3)
        return None

    assert "expected" in run_ranks(2, body)[1]


def test_silent_peer_times_out_with_a_clear_error_and_a_retry_succeeds():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1,))
    seed = 11

    def body(rank, world):
        _, ep, layers, alloc, ir = endpoints(world, rank, ctx, gen)
        if rank == 1:
            first = alloc.alloc(0, 6, [2, 2, 2])
            ep.request(10, first, "ctx", timeout_s=0.3)
            st = ep.check_status(blocking=True)
            assert st.completed == [] and "timed out after 0.3 s waiting for context rank(s) [0]" in st.failed[10]
            assert alloc.leaked == 0 and len(ep.orphans) == 1
            with pytest.raises(TransferError, match="transfer 10: timed out"):
                st.raise_for_failures()
            barrier(world, rank, (0, 1))
            retry = alloc.alloc(0, 6, [2, 2, 2])
            ep.request(11, retry, "ctx")
            st = ep.check_status(blocking=True)
            assert st.completed == [11], st.failed
            report = syn.CheckReport()
            syn.check_generation(MODEL, gen, ir, layers, retry, seed, expect_draft=True, report=report)
            assert report.problems == [] and report.blocks_checked == {"target": 4, "draft": 2}
            return True
        barrier(world, rank, (0, 1))  # stays silent for transfer 10
        req = alloc.alloc(0, 6, [2, 2, 2])
        syn.fill_context(MODEL, layers, req, seed, 0)
        ep.send(11, req, "gen")
        assert ep.wait().completed == [11] and alloc.leaked == 0
        return None

    run_ranks(2, body)


def test_idle_probe_every_rank_takes_the_same_branch():
    """Helix generation group of 4 ranks: the consensus is skipped only when every rank's count is zero."""
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1, 2, 3, 4), cp=4)

    def body(rank, world):
        t, ep, layers, alloc, ir = endpoints(world, rank, ctx, gen)
        everyone = (0, 1, 2, 3, 4)
        if rank == 0:
            barrier(world, rank, everyone)
            req = alloc.alloc(0, 16, [4, 4, 4])
            syn.fill_context(MODEL, layers, req, 3, 0)
            barrier(world, rank, everyone)
            ep.send(5, req, "gen")
            assert ep.wait().completed == [5]
            barrier(world, rank, everyone)
            return None
        assert ep.probe_eligible
        trace = []

        def poll():
            before = (ep.stats.probe_skips, ep.stats.consensus_rounds)
            st = ep.check_status()
            trace.append((ep.stats.probe_skips - before[0], ep.stats.consensus_rounds - before[1], st.completed))

        poll()  # all idle: skipped everywhere
        req = alloc.alloc(5, 16, [1, 1, 1])
        if ir == 2:  # only one rank has a session: everyone must still run the consensus
            ep.request(5, req, "ctx")
        poll()
        barrier(world, rank, everyone)
        if ir != 2:
            ep.request(5, req, "ctx")
        barrier(world, rank, everyone)
        st = ep.check_status(blocking=True)
        assert st.completed == [5]
        barrier(world, rank, everyone)
        poll()  # idle again
        alloc.release(req)
        return trace, t.gathers

    results = run_ranks(5, body)[1:]
    traces = [r[0] for r in results]
    assert all(tr == traces[0] for tr in traces), traces
    assert traces[0] == [(1, 0, []), (0, 1, []), (1, 0, [])]


def test_probe_is_not_used_outside_helix():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1, 2), tp=2)

    def body(rank, world):
        _, ep, *_ = endpoints(world, rank, ctx, gen)
        if rank == 0:
            return None
        assert not ep.probe_eligible
        ep.check_status()
        ep.check_status()
        return ep.stats

    for stats in run_ranks(3, body)[1:]:
        assert stats.probes == 0 and stats.consensus_rounds == 2


def test_consensus_fails_a_transfer_everywhere_when_one_rank_fails_and_at_least_n():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1, 2), tp=2)
    seed = 5

    def body(rank, world):
        _, ep, layers, alloc, ir = endpoints(world, rank, ctx, gen, timeout_s=10)
        everyone = (0, 1, 2)
        if rank == 0:
            reqs = [alloc.alloc(i, 5 + i, [2, 2, 2]) for i in range(3)]
            for r in reqs:
                syn.fill_context(MODEL, layers, r, seed, 0)
            barrier(world, rank, everyone)
            ep.send(100, reqs[0], "gen")
            ep.send(101, reqs[1], "gen")
            st = ep.wait()
            assert sorted(st.completed) == [100, 101]
            barrier(world, rank, everyone)
            alloc.release(reqs[2])  # never sent
            return alloc.leaked
        reqs = [alloc.alloc(i, 5 + i, [2, 2, 2]) for i in range(3)]
        for i, r in enumerate(reqs):
            ep.request(100 + i, r, "ctx")
        barrier(world, rank, everyone)
        st = ep.check_status(at_least=2)
        assert sorted(st.completed) == [100, 101] and not st.failed
        barrier(world, rank, everyone)
        if ir == 1:  # only one rank cancels: the consensus must fail it on both, releasing pages on both
            ep.cancel(102)
        st = ep.check_status(blocking=True)
        assert list(st.failed) == [102] and st.completed == []
        want = "cancelled" if ir == 1 else "failed on generation rank(s) [2] of this instance"
        assert st.failed[102] == want
        for r in reqs[:2]:
            alloc.release(r)
        return alloc.leaked

    assert run_ranks(3, body) == [0, 0, 0]


def test_connect_rejects_an_incompatible_peer_with_both_values():
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1,))
    other = syn.ModelSpec(num_layers=2, head_dim=8, tokens_per_block=8)

    def body(rank, world):
        t = FakeTransport(world, rank)
        inst = ctx if rank == 0 else gen
        model = MODEL if rank == 0 else other
        layers = syn.make_layers(model, inst, 0, POOLS)
        cls = KVSender if rank == 0 else KVReceiver
        ep = cls(t, syn.make_rank_info(model, inst, 0), layers)
        with pytest.raises(ValueError, match=r"tokens_per_block \(page size\): local (4|8) vs peer (8|4)"):
            ep.connect("gen" if rank == 0 else "ctx", (1,) if rank == 0 else (0,))
        return True

    assert run_ranks(2, body) == [True, True]


class _FailingSends(FakeTransport):
    """Raises when posting the send numbered ``fail_at`` (0-based, over this rank's sends)."""

    def __init__(self, world, rank, fail_at: int) -> None:
        super().__init__(world, rank)
        self.fail_at = fail_at
        self.sends = 0
        self.broken: dict[int, str] = {}

    def isend(self, buf, dst, tag):
        n, self.sends = self.sends, self.sends + 1
        if n == self.fail_at:
            raise RuntimeError("injected posting failure")
        return super().isend(buf, dst, tag)

    def mark_broken(self, peer, reason):
        self.broken[peer] = reason


def test_a_posting_failure_fails_the_transfer_and_skips_its_other_messages():
    """Two generation ranks (TP 2), so a transfer is two messages; the first send of transfer 2 fails to post."""
    ctx, gen = syn.InstanceSpec("ctx", (0,)), syn.InstanceSpec("gen", (1, 2), tp=2)

    def body(rank, world):
        if rank == 0:
            t = _FailingSends(world, rank, fail_at=2)
            layers = syn.make_layers(MODEL, ctx, 0, POOLS)
            alloc = syn.PageAllocator(MODEL.total_groups, ctx.num_pages, rank)
            ep = KVSender(t, syn.make_rank_info(MODEL, ctx, 0), layers, release=alloc.release, post_async=POST_ASYNC[0])
            ep.connect(gen.name, gen.ranks)
            t.sends = 0  # count the transfers' messages only (registration sent one frame per peer rank)
            req = [alloc.alloc(i, 8, [2] * MODEL.total_groups) for i in (1, 2)]
            ep.send(1, req[0], gen.name)
            if POST_ASYNC[0]:
                ep.send(2, req[1], gen.name)  # returns at once: the failure surfaces when polled
            else:
                with pytest.raises(RuntimeError, match="injected posting failure"):
                    ep.send(2, req[1], gen.name)
                alloc.release(req[1])  # send raised before taking the request: the caller still owns it
            st = ep.wait()
            ep.close()
            assert st.completed == [1], st
            assert t.sends == 3  # transfer 1's two messages, then transfer 2's first fails and its second is skipped
            assert alloc.leaked == 0
            if POST_ASYNC[0]:
                assert list(st.failed) == [2], st.failed
                assert "posting failed: RuntimeError: injected posting failure" in st.failed[2]
            else:
                assert not st.failed
            return None
        _, ep, _, alloc, _ = endpoints(world, rank, ctx, gen, timeout_s=1.0)
        ir = gen.ranks.index(rank)
        counts = syn.shard_counts(MODEL, gen, ir, 8)
        reqs = {tid: alloc.alloc(tid, 8, counts) for tid in (1, 2)}
        for tid, req in reqs.items():
            ep.request(tid, req, ctx.name)
        st = ep.check_status(blocking=True)
        assert st.completed == [1] and list(st.failed) == [2], st
        alloc.release(reqs[1])  # transfer 1's pages hold its KV until the caller is done with them
        assert alloc.leaked == 0
        return None

    run_ranks(3, body)


def test_post_async_is_checked_and_close_stops_the_thread():
    ctx = syn.InstanceSpec("ctx", (0,))
    world = FakeWorld(2)
    t = FakeTransport(world, 0)
    layers = syn.make_layers(MODEL, ctx, 0, POOLS)
    with pytest.raises(TypeError, match=r"^post_async: expected a bool or None"):
        KVSender(t, syn.make_rank_info(MODEL, ctx, 0), layers, post_async=1)
    ep = KVSender(t, syn.make_rank_info(MODEL, ctx, 0), layers, post_async=True)
    thread = ep._poster._thread
    assert thread.is_alive()
    ep.close()
    assert not thread.is_alive() and ep._poster is None
    ep.close()  # idempotent


# --- attention DP over the in-process transport ---------------------------------------------------------------------

DP_CTX = syn.InstanceSpec("ctx", (0, 1), tp=2, dp=2)  # two DP groups of one rank
DP_GEN = syn.InstanceSpec("gen", (2, 3), tp=2, dp=2)


def test_dp_ranks_are_checked_before_anything_is_posted():
    def body(rank, world):
        _, ep, _, alloc, _ = endpoints(world, rank, DP_CTX, DP_GEN)
        req = alloc.alloc(0, 9, [3, 3, 3])
        if rank in DP_CTX.ranks:
            for bad in (-1, 2, True, "0"):
                with pytest.raises(ValueError, match=r"peer_dp_rank: expected an int in \[0, 2\)"):
                    ep.send(1, req, "gen", peer_dp_rank=bad)
        else:
            with pytest.raises(ValueError, match=r"peer_dp_rank: expected an int in \[0, 2\)"):
                ep.request(1, req, "ctx", peer_dp_rank=2)
        assert not ep.sessions
        return True

    assert all(run_ranks(4, body))


def test_a_transfer_registered_in_two_dp_groups_fails_once_on_each():
    # Both generation ranks register transfer 5 although it can live in one DP group only: a caller error that
    # must end in a clear failure and one release, not a hang or a transfer reported done by the wrong group.
    def body(rank, world):
        _, ep, _, alloc, _ = endpoints(world, rank, DP_CTX, DP_GEN)
        if rank in DP_CTX.ranks:
            return None
        released = []
        ep.release_fn = lambda r: (released.append(r.request_id), alloc.release(r))
        ep.request(5, alloc.alloc(5, 9, [3, 3, 3]), "ctx", peer_dp_rank=0)
        st = ep.check_status()
        assert st.completed == [] and "registered by ranks of DP groups [0, 1]" in st.failed[5], st.failed
        assert released == [5] and alloc.leaked == 0 and not ep.sessions
        return True

    assert run_ranks(4, body)[2:] == [True, True]


FATES = ["ok", "cancel", "silent"]


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1), st.sampled_from(FATES)), min_size=1, max_size=6))
def test_random_dp_transfers_end_once_each_without_leaks(plan):
    # Transfer i is held by context DP group plan[i][0] and generation DP group plan[i][1]; it either arrives,
    # is cancelled by the generation side before the data comes, or is never sent (the receiver times out).
    def body(rank, world):
        _, ep, layers, alloc, ir = endpoints(world, rank, DP_CTX, DP_GEN, timeout_s=1.0)
        ledger: dict[int, int] = defaultdict(int)

        def release(r):
            ledger[r.request_id] += 1
            alloc.release(r)

        ep.release_fn = release
        inst = DP_CTX if rank in DP_CTX.ranks else DP_GEN
        mine = [(i, c, g, fate) for i, (c, g, fate) in enumerate(plan) if (c if inst is DP_CTX else g) == ir]
        reqs = {}
        if inst is DP_GEN:
            for i, c, _, fate in mine:
                reqs[i] = alloc.alloc(i, 5 + i, [-(-(5 + i) // 4)] * 3)
                ep.request(i, reqs[i], "ctx", peer_dp_rank=c)
                if fate == "cancel":
                    ep.cancel(i)
        barrier(world, rank, range(4))
        if inst is DP_CTX:
            for i, _, g, fate in mine:
                if fate == "silent":
                    continue
                req = alloc.alloc(i, 5 + i, [-(-(5 + i) // 4)] * 3)
                syn.fill_context(MODEL, layers, req, 7, 0)
                ep.send(i, req, "gen", peer_dp_rank=g)
            st = ep.wait()
            sent = [i for i, *_, fate in mine if fate != "silent"]
            assert sorted(st.completed) == sent and st.failed == {}
            assert all(ledger[i] == 1 for i in sent) and alloc.leaked == 0
            return True
        st = ep.check_status(blocking=True)
        assert sorted(st.completed) == [i for i, *_, fate in mine if fate == "ok"]
        assert sorted(st.failed) == [i for i, *_, fate in mine if fate != "ok"]
        for i, *_, fate in mine:
            if fate == "ok":
                report = syn.CheckReport()
                syn.check_generation(MODEL, DP_GEN, ir, layers, reqs[i], 7, expect_draft=True, report=report)
                assert report.problems == [] and ledger[i] == 0
                alloc.release(reqs[i])
            else:
                assert ledger[i] == 1, f"transfer {i} ({fate}) released {ledger[i]} times"
        assert alloc.leaked == 0
        return True

    assert all(run_ranks(4, body))

"""Several groups in one process (threads): a step that completed on some members but not others."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ftcomm
from ftcomm.backends.base import AbortSignal, Handle
from ftcomm.core import engine as core
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(120)


def start_groups(n: int, **options) -> list[ftcomm.FaultTolerantGroup]:
    """``n`` groups in threads starting together (min_workers=n-1 unless given, so n-1 may carry on).

    The first view must hold all ``n``: a member that showed up after the others had
    formed theirs would be admitted only at a step boundary, and nobody steps in here. A
    settle interval of 0.5 s (instead of 0.05) lets a slow starter into the first view.
    """
    ports = [free_port() for _ in range(n)]
    groups: list = [None] * n
    options.setdefault("settle_interval", 0.5)
    options.setdefault("min_workers", max(n - 1, 1))

    def start(i: int) -> None:
        groups[i] = ftcomm.init(peers=[f"127.0.0.1:{ports[0]}"] if i else [], bind=f"127.0.0.1:{ports[i]}",
                                handle_signals=False, init_timeout=30, **options)
    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert all(g is not None for g in groups), "not every group was formed"
    assert {g.world_size for g in groups} == {n}, "the first view does not hold every group"
    return groups


def in_threads(groups, fn) -> list:
    results: list = [None] * len(groups)

    def call(i: int) -> None:
        results[i] = fn(i, groups[i])
    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a group's thread did not finish within 60 s"
    return results


def linear_models(groups) -> tuple[list, list]:
    """A small model and its optimizer per group, registered as the group's state."""
    models = [torch.nn.Linear(4, 2) for _ in groups]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for g, m, o in zip(groups, models, optimizers):
        g.register_state(model=m, optimizer=o)
    return models, optimizers


def run_steps(groups, models, optimizers, steps: int) -> None:
    """Train until every group reached the same absolute step (reconciling may move a laggard)."""
    target = max(g.step for g in groups) + steps

    def loop(i: int, g: ftcomm.FaultTolerantGroup) -> None:
        m, o = models[i], optimizers[i]
        while g.step < target:
            m(torch.randn(8, 4, generator=torch.Generator().manual_seed(g.step * 10 + i))).pow(2).sum().backward()
            if g.wait_gradients_ready(m):
                o.step()
            o.zero_grad()
    in_threads(groups, loop)


def join_running(groups, **options) -> ftcomm.FaultTolerantGroup:
    """A fresh worker started beside the running ``groups`` without its state registered:
    init returns at once, the worker holding back in no view. ``options``: the group's
    that must match (GroupOptions)."""
    options.setdefault("min_workers", 1)
    joiner = ftcomm.init(peers=[f"127.0.0.1:{groups[0]._membership.node.port}"], bind="127.0.0.1:0",
                         handle_signals=False, init_timeout=30, settle_interval=0.5, **options)
    assert joiner._loop.awaiting_state and joiner._loop.view is None
    return joiner


def test_a_joiner_that_registers_its_state_late_does_not_pause_the_running_group():
    """The tutorial's order: init first, then build the model, then register_state. The
    joiner holds back from the running group until its state is registered, so the group
    trains on while it builds (before, the group waited in its reconcile for the joiner's
    model); once registered, it enters and receives the group's state."""
    groups = start_groups(2)  # min_workers=1
    joiner = None
    target = [10**9]  # the step everyone trains to (set once the joiner is in)
    commits: list[list[float]] = [[], [], []]
    try:
        models, optimizers = linear_models(groups)

        def train(i: int, g: ftcomm.FaultTolerantGroup, m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
            while g.step < target[0]:
                m(torch.randn(8, 4)).pow(2).sum().backward()
                if g.wait_gradients_ready(m):
                    o.step()
                    commits[i].append(time.monotonic())
                o.zero_grad()
                time.sleep(0.01)
        threads = [threading.Thread(target=train, args=(i, g, models[i], optimizers[i]), daemon=True)
                   for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        while min(len(c) for c in commits[:2]) < 3:
            time.sleep(0.05)
        joiner = join_running(groups)
        returned = time.monotonic()
        time.sleep(4.0)  # building its model
        built = time.monotonic()
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        joiner.register_state(model=model, optimizer=optimizer)  # admitted here
        assert not joiner._loop.awaiting_state and joiner.world_size == 3
        # The group committed steps all the while the joiner built its model.
        for c in commits[:2]:
            assert any(returned + 1.0 < t < built for t in c), "the running group paused for the joiner"
        assert joiner.step >= len(commits[0]) - 1 > 0  # it received the group's state (its step)
        target[0] = joiner.step + 5
        train(2, joiner, model, optimizer)
        for t in threads:
            t.join(30)
        everyone = groups + [joiner]
        assert {g.world_size for g in everyone} == {3} and len(commits[2]) == 5
        assert len({(g.step, g.state.digest(g.step)) for g in everyone}) == 1
    finally:
        target[0] = 0
        for g in groups + ([joiner] if joiner is not None else []):
            g.shutdown()


def test_a_joiner_that_registers_and_trains_on_another_thread_than_init_is_admitted_there():
    """init on one thread, register_state and the sampler's loop on another: the registering
    thread asks for admission and trains (the sampler reads the rank on it)."""
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 2))
    groups = start_groups(2)  # min_workers=1
    joiner = None
    target = [10**9]
    try:
        def train(g: ftcomm.FaultTolerantGroup, ready: threading.Event | None = None) -> None:
            torch.manual_seed(0)
            m = torch.nn.Linear(4, 2)
            o = torch.optim.SGD(m.parameters(), lr=0.1)
            sampler = ftcomm.ElasticSampler(len(data), global_batch=16, seed=1)
            g.register_state(model=m, optimizer=o, sampler=sampler)
            if ready is not None:
                ready.set()
            loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
            while g.step < target[0]:
                for x, y in sampler.steps(loader):
                    torch.nn.functional.mse_loss(m(x), y).backward()
                    if g.wait_gradients_ready(m):
                        o.step()
                    o.zero_grad()
                    if g.step >= target[0]:
                        break
        ready = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=train, args=(g, ready[i]), daemon=True) for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        assert all(r.wait(30) for r in ready)
        joiner = join_running(groups)
        trainer = threading.Thread(target=train, args=(joiner,), daemon=True)
        trainer.start()
        from tests.polling import wait_until
        wait_until(lambda: not joiner._loop.awaiting_state and joiner.view is not None and joiner.step > 0, 30,
                   "the joiner admitted and trained")
        target[0] = max(g.step for g in groups + [joiner]) + 5
        for t in threads + [trainer]:
            t.join(60)
        assert not any(t.is_alive() for t in threads + [trainer])
        everyone = groups + [joiner]
        assert {g.world_size for g in everyone} == {3}
        assert len({(g.step, g.state.digest(g.step)) for g in everyone}) == 1
    finally:
        target[0] = 0
        for g in groups + ([joiner] if joiner is not None else []):
            g.shutdown()


def test_a_step_committed_by_some_members_only_is_reconciled_from_the_most_advanced():
    groups = start_groups(4)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 5)
        assert {g.world_size for g in groups} == {4}
        assert len({g.state.digest(g.step) for g in groups}) == 1
        # Member 2 missed the last step: its step counter and model are one step behind.
        laggard = groups[2]
        laggard.step -= 1
        with torch.no_grad():
            models[2].weight.add_(0.5)
        assert len({(g.step, g.state.digest(g.step)) for g in groups}) == 2
        # The view changes (member 3 leaves); the survivors reconcile before the next step.
        groups[3].shutdown()
        run_steps(groups[:3], models[:3], optimizers[:3], 3)
        survivors = groups[:3]
        change = next(e for e in reversed(survivors[0].events) if e.reason == "leave")
        assert change.state_digest is not None
        assert len({g.step for g in survivors}) == 1
        assert len({g.state.digest(g.step) for g in survivors}) == 1
        stamped = {next(e for e in g.events if e.view_id == change.view_id).state_digest for g in survivors}
        assert stamped == {change.state_digest}
    finally:
        for g in groups:
            g.shutdown()


def test_execute_runs_collectives_over_the_view_and_retries_after_a_member_leaves():
    groups = start_groups(4)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 1)  # everyone in one view

        def collectives(i: int, g: ftcomm.FaultTolerantGroup):
            def fn():
                total = g.allreduce(torch.full((3,), float(g.rank + 1)), "sum")
                biggest = g.allreduce(torch.tensor([float(g.rank)]), "max")
                mine = torch.tensor([float(g.rank) * 10])
                gathered = g.allgather(mine)
                source = g.broadcast(torch.tensor([float(g.rank) + 100]), 0)
                g.barrier()
                return total.tolist(), biggest.item(), [t.item() for t in gathered], source.item(), g.world_size
            return g.execute(fn)

        first = in_threads(groups, collectives)
        assert {r[0][0] for r in first} == {10.0} and {r[1] for r in first} == {3.0}
        assert {tuple(r[2]) for r in first} == {(0.0, 10.0, 20.0, 30.0)} and {r[3] for r in first} == {100.0}
        groups[3].shutdown()
        second = in_threads(groups[:3], collectives)  # the first attempt aborts; execute retries
        assert {r[4] for r in second} == {3} and {r[0][0] for r in second} == {6.0}
        assert any(e.reason == "leave" for e in groups[0].events)
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("wrapped", [False, True])
def test_wait_gradients_ready_averages_exactly_with_and_without_overlap(overlap, wrapped):
    """Three workers, different data, small buckets, one step accumulated over two
    micro-batches in ``no_sync``: the gradients handed back are the mean. With the model
    as it is, and through ``ft.wrap`` (DDP's reducer)."""
    groups = start_groups(3, overlap=overlap, bucket_mb=0.0002)
    try:
        def make() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 2))
        models = [make() for _ in groups]
        reference = [make() for _ in groups]
        inputs = [[torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * s + i)) for s in range(5)]
                  for i in range(len(groups))]
        nets = [g.wrap(m) for g, m in zip(groups, models)] if wrapped else models

        def train(i: int, g: ftcomm.FaultTolerantGroup) -> list[bool]:
            optimizer = torch.optim.SGD(models[i].parameters(), lr=0.05)
            results = []
            for s in range(4):
                if s == 2:
                    with g.no_sync():
                        nets[i](inputs[i][4]).pow(2).mean().backward()
                nets[i](inputs[i][s]).pow(2).mean().backward()
                results.append(g.wait_gradients_ready(nets[i]))
                optimizer.step()
                optimizer.zero_grad(set_to_none=s % 2 == 0)
            return results

        assert in_threads(groups, train) == [[True] * 4] * 3
        # The same four steps without ftcomm: average the three local gradients by hand.
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in reference]
        for s in range(4):
            for i, m in enumerate(reference):
                if s == 2:
                    m(inputs[i][4]).pow(2).mean().backward()
                m(inputs[i][s]).pow(2).mean().backward()
            for params in zip(*(m.parameters() for m in reference)):
                mean = sum(p.grad for p in params) / len(params)
                for p in params:
                    p.grad = mean.clone()
            for o in optimizers:
                o.step()
                o.zero_grad()
        for m in models:
            for p, q in zip(m.parameters(), reference[0].parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert groups[0]._collective.buckets.bucket_count >= 3
        assert type(groups[0]._collective.buckets).__name__ == ("ReducerBuckets" if wrapped else "GradientBuckets")
    finally:
        for g in groups:
            g.shutdown()


def test_gradients_summed_in_bfloat16_are_the_rounded_mean_and_a_change_of_wire_dtype_takes_the_next_step():
    """Two workers, overlap on. A dtype that is not a wire's is refused before anything
    starts. Then float32, bfloat16, bfloat16, float32, float32: a call whose backward
    already began its reductions in the other dtype (the hooks of the buckets it had) is
    summed in that dtype and commits; the next is summed in the dtype asked for. Summed in
    bfloat16, every gradient is the bfloat16 sum of the bfloat16 halves, on both workers."""
    groups = start_groups(2)
    wires = (torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    summed_in = (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32)
    try:
        def train(i: int, g: ftcomm.FaultTolerantGroup) -> list:
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 4)
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
            with pytest.raises(ValueError, match="wire_dtype"):
                g.wait_gradients_ready(model, wire_dtype=torch.float64)
            results = []
            for wire in wires:
                model(x).pow(2).mean().backward()
                local = [p.grad.clone() for p in model.parameters()]
                committed = g.wait_gradients_ready(model, wire_dtype=wire)
                results.append((committed, local, [p.grad.clone() for p in model.parameters()]))
                model.zero_grad()
            return results

        results = in_threads(groups, train)
    finally:
        for g in groups:
            g.shutdown()
    assert [r[0] for r in results[0]] == [True] * len(wires) == [r[0] for r in results[1]]
    for step, dtype in enumerate(summed_in):
        a, b = results[0][step], results[1][step]
        for local_a, local_b, mean_a, mean_b in zip(a[1], b[1], a[2], b[2]):
            assert torch.equal(mean_a, mean_b)
            if dtype == torch.bfloat16:
                halves = (local_a / 2).bfloat16(), (local_b / 2).bfloat16()
                assert torch.equal(mean_a, (halves[0] + halves[1]).float())
            else:
                torch.testing.assert_close(mean_a, (local_a + local_b) / 2, rtol=1e-6, atol=1e-7)
                assert not torch.equal(mean_a, mean_a.bfloat16().float())


def test_gradients_summed_in_int8_are_the_quantized_mean_bit_equal_on_both_workers():
    """Two workers, a model of several quantization blocks in two buckets, overlap on: summed
    in 8-bit integers, every gradient is what the int8 sum computed alone gives for the
    workers' halves laid out in their buckets, on both workers bit for bit; the counters
    still count (the step commits, twice)."""
    from ftcomm.training.quantized import reference_sum
    groups = start_groups(2, bucket_mb=0.0001)  # 104 bytes: as many int8 elements a bucket
    try:
        def train(i: int, g: ftcomm.FaultTolerantGroup) -> list:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 3))
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(i))
            results = []
            for _ in range(2):
                model(x).pow(2).mean().backward()
                local = [p.grad.clone() for p in model.parameters()]
                committed = g.wait_gradients_ready(model, wire_dtype=torch.int8)
                results.append((committed, local, [p.grad.clone() for p in model.parameters()]))
                model.zero_grad()
            return results, [[len(b) for b in g._collective.buckets._groups]]

        results = in_threads(groups, train)
    finally:
        for g in groups:
            g.shutdown()
    (steps_a, layout), (steps_b, _) = results
    assert len(layout[0]) >= 3 and layout[0][-1] == 0  # the gradients' buckets, then the counters alone
    for (committed_a, local_a, mean_a), (committed_b, local_b, mean_b) in zip(steps_a, steps_b):
        assert committed_a and committed_b
        for a, b in zip(mean_a, mean_b):
            assert torch.equal(a, b)
        order = list(range(4))[::-1]  # the buckets hold the parameters in reverse
        per_bucket, start = [], 0
        for n in layout[0][:-1]:
            per_bucket.append(order[start:start + n])
            start += n
        for members in per_bucket:
            flats = [torch.cat([local[j].reshape(-1) / 2 for j in members]) for local in (local_a, local_b)]
            summed, offset = reference_sum(flats), 0
            for j in members:
                n = mean_a[j].numel()
                assert torch.equal(mean_a[j], summed[offset:offset + n].view_as(mean_a[j]))
                offset += n
            assert not torch.equal(summed, flats[0] + flats[1])  # rounded: it did travel in int8


def _observe_completions_late(group: ftcomm.FaultTolerantGroup, delay: float,
                              operations: tuple[str, ...] = ("allreduce",)) -> None:
    """This member's training thread learns that its ``operations`` completed ``delay`` seconds
    late, as a descheduled worker would: the collective itself is done at the usual time."""
    comm = group._comms.comm

    def late(real):
        def call(*args, **kwargs):
            handle = real(*args, **kwargs)
            seen_done_at: list[float] = []

            def done() -> bool:
                if not seen_done_at and handle.completed:
                    seen_done_at.append(time.monotonic())
                return bool(seen_done_at) and time.monotonic() - seen_done_at[0] >= delay
            return Handle(handle.what, done, lambda: handle.wait(AbortSignal()))
        return call
    for name in operations:
        setattr(comm, name, late(getattr(comm, name)))


@pytest.mark.parametrize("operation", ["barrier", "allreduce", "broadcast", "allgather"])
def test_a_member_leaving_right_after_a_collective_does_not_abort_it_on_a_slower_member(operation):
    """Every member calls one collective and the fastest leaves as soon as it returns (the end
    of a job: a barrier, then shutdown). The leaver's share is already sent: the collective
    completes on the slower member instead of raising CollectiveAborted."""
    groups = start_groups(3, overlap=False, leave_grace=5.0)
    try:
        calls = {"barrier": lambda g: g.barrier(),
                 "allreduce": lambda g: g.allreduce(torch.ones(3)).tolist(),
                 "broadcast": lambda g: g.broadcast(torch.tensor([float(g.rank)]), 0).tolist(),
                 "allgather": lambda g: [t.item() for t in g.allgather(torch.tensor([1.0]))]}
        for g in groups[1:]:
            _observe_completions_late(g, 0.8, (operation,))

        def collective_then_leave(i: int, g: ftcomm.FaultTolerantGroup):
            try:
                return calls[operation](g)
            finally:
                if i == 0:
                    g.shutdown()
        results = in_threads(groups, collective_then_leave)
        assert len({repr(r) for r in results}) == 1, results
        for survivor in groups[1:]:
            assert "left after completing" in survivor._loop.news.abort.reason
    finally:
        for g in groups:
            g.shutdown()


@pytest.mark.parametrize("delay, grace, committed", [(0.8, 5.0, True), (1.5, 0.2, False)])
def test_a_member_leaving_after_the_last_step_lets_a_slower_member_commit_it(delay, grace, committed):
    """Member 0 commits a step and leaves at once (the end of a job). Member 1 contributed
    to the same step but observes its completion later; member 0's share is already sent,
    so the step commits on member 1 too (within ``leave_grace``) and then the view re-forms.
    Past ``leave_grace`` the step is discarded instead of waiting on."""
    groups = start_groups(2, overlap=False, leave_grace=grace)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 2)
        _observe_completions_late(groups[1], delay)

        def last_step(i: int, g: ftcomm.FaultTolerantGroup) -> bool:
            models[i](torch.ones(8, 4) * (i + 1)).pow(2).sum().backward()
            ok = g.wait_gradients_ready(models[i])
            if ok:
                optimizers[i].step()
            if i == 0:
                g.shutdown()
            return ok
        results = in_threads(groups, last_step)
        assert results == [True, committed]
        leaver, survivor = groups
        if committed:
            assert survivor.step == leaver.step
            assert survivor.state.digest(survivor.step) == leaver.state.digest(leaver.step)
            assert "left after completing" in survivor._loop.news.abort.reason
        else:
            assert survivor.step == leaver.step - 1
        # either way the survivor carries on alone in a new view
        run_steps([survivor], models[1:], optimizers[1:], 1)
        assert survivor.world_size == 1 and survivor.events[-1].reason == "leave"
    finally:
        for g in groups:
            g.shutdown()


def test_a_leaver_stays_reachable_until_the_slower_member_finished_the_step_it_left_after():
    """The leaver's process exit would close the connections a slower member still reads the
    last step from: its shutdown returns only once that member finished the step and moved on
    (here: re-formed without it), well before ``leave_grace`` runs out."""
    groups = start_groups(2, overlap=False, leave_grace=30.0)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 2)
        _observe_completions_late(groups[1], 0.8)
        finished: dict[int, float] = {}

        def last_step(i: int, g: ftcomm.FaultTolerantGroup) -> bool:
            models[i](torch.ones(8, 4) * (i + 1)).pow(2).sum().backward()
            ok = g.wait_gradients_ready(models[i])
            finished[i] = time.monotonic()
            if i == 0:
                g.shutdown()
                finished["left"] = time.monotonic()
            else:
                g.execute(g.barrier)  # the survivor's next collective: it re-forms alone
            return ok
        assert in_threads(groups, last_step) == [True, True]
        assert finished[1] <= finished["left"], "the leaver left while the other was still in the step"
        assert groups[1].world_size == 1 and groups[1].events[-1].reason == "leave"
    finally:
        for g in groups:
            g.shutdown()


def test_gossip_news_is_judged_on_the_waiting_thread_never_on_the_gossip_thread(monkeypatch):
    """The gossip thread only posts news and wakes the waiter; the engine runs on one thread."""
    judged_on: list[str] = []
    real_damage = core.Engine.damage

    def damage(self, *args, **kwargs):
        judged_on.append(threading.current_thread().name)
        return real_damage(self, *args, **kwargs)
    monkeypatch.setattr(core.Engine, "damage", damage)
    groups = start_groups(3)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 1)
        waiting = threading.Event()

        def barrier_then_size(i: int, g: ftcomm.FaultTolerantGroup):
            def fn():
                waiting.set()
                g.barrier()
                return g.world_size
            return g.execute(fn)

        leaver = threading.Thread(target=lambda: (waiting.wait(10), time.sleep(0.2), groups[2].shutdown()))
        leaver.start()
        sizes = in_threads(groups[:2], barrier_then_size)
        leaver.join()
        assert judged_on and not [name for name in judged_on if name.startswith("ftcomm-gossip")], judged_on
        assert sizes == [2, 2]  # the third never entered the barrier: it was aborted and retried without it
        assert all(g.events[-1].reason == "leave" for g in groups[:2])
    finally:
        for g in groups:
            g.shutdown()


def test_a_collective_waiting_far_longer_than_usual_probes_its_members_and_a_silent_one_is_excluded():
    """Hang detection on demand: member 2 goes silent (its packets vanish, its training thread
    stops calling collectives). Regular probes run only every 5 s here; the others' allreduce
    waits beyond ``stall_probe_after``, probes the view's members at once, suspects member 2
    and re-forms without it."""
    from ftcomm.gossip import FaultFilter

    silent = FaultFilter()
    filters = [None, None, silent]
    ports = [free_port() for _ in range(3)]
    groups: list = [None] * 3

    def start(i: int) -> None:
        groups[i] = ftcomm.init(peers=[f"127.0.0.1:{ports[0]}"] if i else [], bind=f"127.0.0.1:{ports[i]}",
                                min_workers=2, handle_signals=False, init_timeout=30, settle_interval=0.5,
                                fault_filter=filters[i], gossip={"probe_interval": 5.0})
    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    try:
        assert all(g is not None and g.world_size == 3 for g in groups)
        for _ in range(5):  # the usual wait of a collective
            in_threads(groups, lambda i, g: g.execute(lambda: g.allreduce(torch.ones(2))))
        silent.drop_rate = 1.0
        results = in_threads(groups[:2], lambda i, g: g.execute(lambda: g.allreduce(torch.ones(2))).tolist())
        assert results == [[2.0, 2.0], [2.0, 2.0]]
        assert all(g.world_size == 2 and g.events[-1].reason == "hang" for g in groups[:2])
        assert sum(g.gossip.stats()["urgent_probes"] for g in groups[:2]) > 0
    finally:
        silent.clear()
        for g in groups:
            if g is not None:
                g.shutdown()


def test_a_member_slow_in_compute_is_probed_but_never_suspected_while_its_process_answers():
    """Hang detection must not mistake slow compute for a hang: member 2 spins in Python
    (holding the GIL between switches) for far longer than the collective usually waits.
    The others' allreduce waits, probes it at once, and its gossip thread answers: the
    view stays, nobody is suspected, and the collective completes with all three."""
    groups = start_groups(3)
    try:
        for _ in range(5):  # the usual wait of a collective
            in_threads(groups, lambda i, g: g.execute(lambda: g.allreduce(torch.ones(2))))
        views = [g.view.id for g in groups]

        def slow(i, g):
            if i == 2:
                until = time.monotonic() + 1.5
                while time.monotonic() < until:
                    sum(range(1000))
            return g.execute(lambda: g.allreduce(torch.ones(2))).tolist()
        assert in_threads(groups, slow) == [[3.0, 3.0]] * 3
        assert [g.view.id for g in groups] == views and all(g.world_size == 3 for g in groups)
        assert sum(g.gossip.stats()["urgent_probes"] for g in groups[:2]) > 0  # it was probed ...
        assert sum(g.gossip.stats().get("probes_failed", 0) for g in groups) == 0  # ... and answered
    finally:
        for g in groups:
            g.shutdown()


def test_stragglers_standing_aside_never_leave_fewer_than_min_workers():
    """Four members, min_workers=3 (so one may stand aside), two of them slow alike: each
    judges itself a straggler. Only one may stand aside; the fast two must go on training
    (the cooldown outlasts the test, so a member that stood aside is not back in time)."""
    from .polling import wait_until

    groups = start_groups(4, straggler_policy="exclude", straggler_cooldown=120.0, step_publish_interval=0.1)
    models, optimizers = linear_models(groups)
    slow = {2, 3}
    stop = threading.Event()

    def loop(i: int, g: ftcomm.FaultTolerantGroup) -> None:
        m, o = models[i], optimizers[i]
        while not stop.is_set():
            if i in slow:
                time.sleep(0.05)  # compute: the others take a few milliseconds
            m(torch.ones(8, 4)).pow(2).sum().backward()
            try:
                if g.wait_gradients_ready(m):
                    o.step()
            except ftcomm.FtcommError:
                if stop.is_set():
                    return  # the test ended: the groups were shut down under the loop
                raise
            o.zero_grad()
    threads = [threading.Thread(target=loop, args=(i, g), daemon=True) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    try:
        fast = groups[:2]
        wait_until(lambda: all(any(r.member == groups[i].id and r.slow for r in groups[i].stragglers) for i in slow),
                   60, "both slow members judging themselves stragglers")
        since = max(g.step for g in groups)
        wait_until(lambda: min(g.step for g in fast) >= since + 100, 60, "the fast members training on")
        assert any(e.reason == "straggler" for e in fast[0].events) and fast[0].world_size == 3
        # The one standing aside (its training thread waits out the cooldown) is in no view.
        aside = [g for g in groups if g._loop.engine.state == core.STANDING_ASIDE]
        assert len(aside) == 1
        for attribute in ("rank", "world_size"):
            with pytest.raises(ftcomm.NotInView, match="stands aside as a straggler"):
                getattr(aside[0], attribute)
    finally:
        stop.set()
        for g in groups:
            g.shutdown()


def test_wait_gradients_ready_gives_up_after_max_retries_failed_steps_in_a_row(monkeypatch):
    """Every step's reduction fails (as when the membership changes under every step): each
    call re-forms and returns False, until the (max_retries + 1)-th raises
    RetryLimitExceeded; a later call re-forms and trains again."""
    from ftcomm.training.buckets import GradientBuckets
    from ftcomm.errors import CommunicatorError

    (g,) = start_groups(1, max_retries=2)
    model = torch.nn.Linear(4, 2)
    g.register_state(model=model)
    finish = GradientBuckets.finish

    def failing(self, valid):
        raise CommunicatorError("injected: a peer reset the connection")
    try:
        monkeypatch.setattr(GradientBuckets, "finish", failing)
        views = []
        for _ in range(2):
            model(torch.ones(3, 4)).sum().backward()
            assert g.wait_gradients_ready(model) is False
            views.append(g.view.id)
        model(torch.ones(3, 4)).sum().backward()
        with pytest.raises(ftcomm.RetryLimitExceeded, match="failed 3 steps in a row"):
            g.wait_gradients_ready(model)
        assert views[1] > views[0] and g._loop.engine.state == core.BROKEN
        monkeypatch.setattr(GradientBuckets, "finish", finish)
        model(torch.ones(3, 4)).sum().backward()
        assert g.wait_gradients_ready(model) is True and g.view.id > views[1] and g.step == 1
    finally:
        g.shutdown()


def test_shutdown_from_another_thread_while_the_training_thread_recovers_ends_it_with_a_clear_error():
    """The training thread waits to agree on a view (its peer left) when another thread (an
    exit hook, a supervisor) shuts the group down: it gets FtcommError, not an internal one."""
    groups = start_groups(3)  # min_workers=2
    try:
        outcome: list = []

        def train() -> None:
            try:
                groups[0].execute(groups[0].barrier)
            except BaseException as exc:  # noqa: BLE001 - the test looks at what came out
                outcome.append(exc)
        groups[1].shutdown()  # the view breaks; alone, group 0 cannot form one (min_workers=2)
        groups[2].shutdown()
        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        time.sleep(0.5)  # it is now waiting in agreement (nothing can form)
        groups[0].shutdown()
        thread.join(30)
        assert not thread.is_alive()
        assert len(outcome) == 1 and type(outcome[0]) is ftcomm.FtcommError, outcome
        assert "shut down" in str(outcome[0])
    finally:
        for g in groups:
            g.shutdown()


def test_shutdown_from_another_thread_during_a_step_ends_it_as_shut_down_not_as_a_failed_step():
    """The training thread waits in wait_gradients_ready (its peer computes on) when another
    thread shuts the group down: FtcommError saying so, even with max_retries=0 (not
    RetryLimitExceeded, and no engine input the leaving state refuses)."""
    from .polling import wait_until

    groups = start_groups(2, max_retries=0)
    models, _ = linear_models(groups)
    model = models[0]
    in_threads(groups, lambda i, g: g.allreduce(torch.ones(1)))  # both reconciled: RUNNING
    life = groups[0]._loop
    outcome: list = []

    def train() -> None:
        model(torch.ones(3, 4)).sum().backward()
        try:
            outcome.append(groups[0].wait_gradients_ready(model))
        except BaseException as exc:  # noqa: BLE001 - the test looks at what came out
            outcome.append(exc)
    try:
        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        wait_until(lambda: life.contributed_at > life.op_began, 30, "the step waiting on the peer")
        groups[0].shutdown()
        thread.join(30)
        assert not thread.is_alive()
        assert len(outcome) == 1 and type(outcome[0]) is ftcomm.FtcommError and "shut down" in str(outcome[0]), outcome
        assert life.engine.state == core.CLOSED
        with pytest.raises(ftcomm.FtcommError, match="shut down"):
            groups[0].state_restored(3)
        with pytest.raises(ftcomm.FtcommError, match="shut down"):
            groups[0].register_state(model=torch.nn.Linear(4, 2))
    finally:
        for g in groups:
            g.shutdown()


def test_a_re_formation_that_timed_out_is_resumed_by_the_next_call():
    """The view broke and no view could be agreed within quorum_timeout (the others left:
    min_workers=2 cannot be met): the call raises. The next call re-forms from where the
    engine stands (no stale communicator is used) and succeeds once a worker joins."""
    groups = start_groups(3, quorum_timeout=1.0)  # min_workers=2
    port = free_port()
    joiner: list = []
    try:
        groups[1].shutdown()
        groups[2].shutdown()
        with pytest.raises((ftcomm.QuorumLost, ftcomm.FtcommTimeout)):
            groups[0].execute(groups[0].barrier)
        assert groups[0]._loop.engine.state == core.AGREEING

        def join() -> None:
            joiner.append(ftcomm.init(peers=[groups[0].gossip.address], bind=f"127.0.0.1:{port}", min_workers=2,
                                      handle_signals=False, init_timeout=30, quorum_timeout=1.0))
            joiner[0].barrier()
        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        for _ in range(30):  # each call waits up to quorum_timeout for the joiner
            try:
                groups[0].barrier()
                break
            except (ftcomm.QuorumLost, ftcomm.FtcommTimeout):
                continue
        thread.join(30)
        assert groups[0].world_size == 2 and joiner and joiner[0].world_size == 2
    finally:
        for g in groups + joiner:
            g.shutdown()


def test_only_the_training_thread_acts_at_a_step_boundary():
    # A loader or prefetch thread that iterates the sampler calls step_boundary too: a join
    # (a collective) run from there would race the training thread's own collectives.
    groups = start_groups(2)
    trained, release = threading.Barrier(3, timeout=60), threading.Event()
    results: list = [None, None]

    def train(i: int, g) -> None:
        g.allreduce(torch.ones(1))  # this thread now trains
        trained.wait()
        release.wait(60)
        g.step_boundary()
        results[i] = (g._loop.engine.state, g.view.id)

    threads = [threading.Thread(target=train, args=(i, g), daemon=True) for i, g in enumerate(groups)]
    try:
        for t in threads:
            t.start()
        trained.wait()
        before = groups[0].view.id
        for g in groups:
            g._loop.engine.step_reduced(admit=True, aside=False)  # as when the last step's tail counted a joiner
        for g in groups:
            g.step_boundary()  # from another thread: nothing happens
        assert all(g._loop.engine.state == core.JOIN_DUE for g in groups) and {g.view.id for g in groups} == {before}
        release.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert results[0] == results[1] == (core.RUNNING, results[0][1]) and results[0][1] > before  # re-formed
    finally:
        release.set()
        for g in groups:
            g.shutdown()


def test_a_step_whose_reductions_a_re_formation_dropped_does_not_commit():
    """With overlap, backward starts reducing; a member leaves and a collective run through
    ``execute`` re-forms the view before the step's ``wait_gradients_ready``: the step's
    reductions belonged to the old view, so it reports the step lost (no collective), and
    the next one commits in the new view."""
    groups = start_groups(3, overlap=True, bucket_mb=0.0002)
    try:
        def make() -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        models = [make() for _ in groups]
        for g, m in zip(groups, models):
            g.register_state(model=m)

        def step(i: int, g: ftcomm.FaultTolerantGroup) -> bool:
            models[i](torch.randn(5, 8)).pow(2).mean().backward()
            committed = g.wait_gradients_ready(models[i])
            for p in models[i].parameters():
                p.grad = None
            return committed
        assert in_threads(groups, step) == [True] * 3  # the first step installs the hooks

        def backward(i: int, g: ftcomm.FaultTolerantGroup) -> bool:
            models[i](torch.randn(5, 8)).pow(2).mean().backward()
            return g._collective.buckets.touched
        assert in_threads(groups, backward) == [True] * 3  # reductions under way
        groups[2].shutdown()
        survivors = groups[:2]
        in_threads(survivors, lambda i, g: g.execute(g.barrier))  # re-forms without the leaver
        assert {g.world_size for g in survivors} == {2}
        before = [g.step for g in survivors]
        assert in_threads(survivors, lambda i, g: g.wait_gradients_ready(models[i])) == [False, False]
        assert [g.step for g in survivors] == before
        assert in_threads(survivors, step) == [True, True]
        assert [g.step for g in survivors] == [b + 1 for b in before]
    finally:
        for g in groups:
            g.shutdown()


def test_a_worker_waiting_below_min_workers_says_why_and_for_how_long(caplog):
    import logging

    from ftcomm.errors import FtcommTimeout

    caplog.set_level(logging.WARNING, logger="ftcomm")
    with pytest.raises(FtcommTimeout):
        ftcomm.init(bind=f"127.0.0.1:{free_port()}", min_workers=2, handle_signals=False, init_timeout=7.0)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for a view")]
    assert said, caplog.text
    assert "1 live member here, fewer than min_workers=2" in said[0] and "FtcommTimeout in" in said[0], said


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_view_that_re_forms_in_a_call_between_backward_and_the_step_runs_the_step_on_every_member(wrapped):
    """With overlap, member 0's backward has launched the step's buckets when member 2
    leaves; member 1's backward begins only once it has the news, so it launches nothing.
    Both re-form inside the metric averaged before the step (execute) and run it again.
    Member 0's share went with the old view: it runs the step all the same, its gradients
    counted as none, instead of skipping it while member 1 waits in it for ever; the step
    commits on both with member 1's gradients, and they train on with equal states. The
    same through ``ft.wrap`` (DDP's reducer)."""
    groups = start_groups(3)
    backward_done, left = threading.Event(), threading.Event()
    try:
        models, optimizers = linear_models(groups)
        nets = [g.wrap(m) for g, m in zip(groups, models)] if wrapped else models
        run_steps(groups, nets, optimizers, 2)  # the hooks are installed: backward reduces from now on

        def step(i: int, g: ftcomm.FaultTolerantGroup):
            m, o = nets[i], optimizers[i]
            if i == 2:
                backward_done.wait(20)
                g.shutdown()
                left.set()
                return None
            if i == 1:
                left.wait(20)
                deadline = time.monotonic() + 20
                while g._loop.may_overlap() and time.monotonic() < deadline:
                    time.sleep(0.01)  # until this member has the news of the departure
            m(torch.randn(8, 4)).pow(2).sum().backward()
            began = g._collective.touched
            if i == 0:
                backward_done.set()
                left.wait(20)
            mean = g.execute(lambda: g.allreduce(torch.ones(1)))
            lost = g._collective.lost
            commit = g.wait_gradients_ready(m)
            if commit:
                o.step()
            o.zero_grad()
            return began, lost, mean.item(), commit, g.world_size
        outcomes = in_threads(groups, step)
        assert outcomes[0] == (True, True, 2.0, True, 2)
        assert outcomes[1] == (False, False, 2.0, True, 2)
        survivors = groups[:2]
        assert len({(g.step, g.state.digest(g.step)) for g in survivors}) == 1
        run_steps(survivors, nets[:2], optimizers[:2], 3)
        assert len({(g.step, g.state.digest(g.step)) for g in survivors}) == 1
    finally:
        for g in groups:
            g.shutdown()

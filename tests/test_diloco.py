"""DiLoCo and LocalSGD: inner steps alone, outer steps committed as one across the group.

The thread tests run several groups in one process on loopback; the process tests run
the example's DiLoCo mode and kill, stop and add workers while it trains."""

from __future__ import annotations

import copy
import signal
import threading

import pytest
import torch

import ftcomm
from ftcomm.errors import FtcommError
from ftcomm.training.data import epoch_permutation
from ftcomm.training.quantized import reference_sum
from tests.polling import wait_until
from tests.test_group_threads import in_threads, join_running, start_groups
from tests.train_cluster import assert_invariants

pytestmark = pytest.mark.timeout(180)

SAMPLES, BATCH, SEED = 96, 8, 3
DATA = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(0))
TARGET = DATA @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1, generator=torch.Generator().manual_seed(1))


def model_and_optimizers(outer_lr: float | None):
    model = torch.nn.Linear(4, 1)
    with torch.no_grad():  # not torch's global generator: the groups' threads build theirs at once
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    outer = None if outer_lr is None else torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=0.9,
                                                          nesterov=True)
    return model, inner, outer


def make(group, sync_every: int, outer_lr: float | None, **streaming):
    """A DiLoCo (LocalSGD when ``outer_lr`` is None) and its sampler, registered with ``group``;
    ``streaming``: DiLoCo's ``fragments``, ``quantize`` and ``delay``."""
    model, inner, outer = model_and_optimizers(outer_lr)
    sampler = ftcomm.ElasticSampler(SAMPLES, global_batch=BATCH, seed=SEED)
    if outer is None:
        algorithm = ftcomm.LocalSGD(group, model, inner, sync_every=sync_every)
    else:
        algorithm = ftcomm.DiLoCo(group, model, inner, outer_optimizer=outer, sync_every=sync_every, **streaming)
    group.register_state(diloco=algorithm, sampler=sampler)
    return model, algorithm, sampler


def inner_step(model, indices) -> None:
    torch.nn.functional.mse_loss(model(DATA[indices]), TARGET[indices]).backward()


def outer_steps(group, model, algorithm, sampler, until: int) -> list[bool]:
    """Inner steps on the sampler's batches until ``group`` committed ``until`` outer steps;
    what each outer step returned (True committed, False discarded), in order."""
    results = []
    while group.step < until:
        for indices in sampler:
            inner_step(model, indices)
            result = algorithm.step()
            if result is not None:
                results.append(result)
            if group.step >= until:
                break
    return results


def reference(world: int, sync_every: int, outer_lr: float | None, outer_steps: int, fragments: int = 1,
              quantize: torch.dtype | None = None, delay: int = 0) -> list[torch.Tensor]:
    """The global model after ``outer_steps`` outer steps of ``world`` workers, computed alone:
    each worker's inner steps on its share of each inner batch (``sync_every / fragments``
    of them per outer step), the mean pseudo-gradient of the outer step's fragment (the
    model's parameters taken in turn; each worker's share of the sum rounded to
    ``quantize``, and the sum too, as the all-reduce does) taken ``delay`` inner steps
    before the last, the outer optimizer's step, and that fragment of every worker's local
    model set to the global one plus what its last ``delay`` inner steps changed in it."""
    model, _, outer = model_and_optimizers(outer_lr)
    if outer is None:
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
    interval, globals_ = sync_every // fragments, list(model.parameters())
    workers = []
    for rank in range(world):
        local, inner, _ = model_and_optimizers(None)
        sampler = ftcomm.ElasticSampler(SAMPLES, global_batch=BATCH, seed=SEED, rank=rank, world_size=world)
        sampler.plan_inner_steps(interval)
        workers.append((local, inner, sampler, iter(()), [sampler.epoch]))
    for step in range(outer_steps):
        part = [i for i in range(len(globals_)) if i % fragments == step % fragments]  # (one parameter a fragment)
        deltas, kept = [], []
        for w, (local, inner, sampler, batches, epoch) in enumerate(workers):
            params = list(local.parameters())
            for k in range(interval):
                indices = next(batches, None)
                if indices is None:
                    batches = iter(sampler)
                    indices = next(batches)
                inner_step(local, indices)
                inner.step()
                inner.zero_grad()
                if k == interval - 1 - delay:  # the pseudo-gradient taken (and sent)
                    deltas.append({i: globals_[i].detach() - params[i].detach() for i in part})
                    kept.append({i: params[i].detach().clone() for i in part})
                if sampler.offset == 0 and sampler.epoch != epoch[0]:
                    epoch[0] = sampler.epoch
                    assert k == interval - 1, "a short outer step at an epoch's end: not modelled here"
                    break  # the epoch's last outer step ended
            workers[w] = (local, inner, sampler, batches, epoch)
        if quantize == torch.int8:  # each worker's share in its bucket (the carrier's layout with fragments)
            order = part if fragments > 1 else part[::-1]
            size = max(sum(globals_[j].numel() for j in range(len(globals_)) if j % fragments == f)
                       for f in range(fragments)) if fragments > 1 else sum(globals_[i].numel() for i in part)
            flats = []
            for d in deltas:
                flat = torch.zeros(size)
                flat[:sum(globals_[i].numel() for i in part)] = torch.cat([d[i].reshape(-1) / world for i in order])
                flats.append(flat)
            summed, offset = reference_sum(flats), 0
            for i in order:
                globals_[i].grad = summed[offset:offset + globals_[i].numel()].view_as(globals_[i]).clone()
                offset += globals_[i].numel()
        for i in part if quantize != torch.int8 else ():
            if quantize is None:
                globals_[i].grad = sum(d[i] for d in deltas) / world
            else:
                shares = [(d[i] / world).to(quantize) for d in deltas]
                globals_[i].grad = sum(shares[1:], shares[0]).float()
        outer.step()
        outer.zero_grad(set_to_none=True)
        for w, (local, *_) in enumerate(workers):
            with torch.no_grad():
                for i in part:
                    p = list(local.parameters())[i]
                    p.copy_(globals_[i] if not delay else globals_[i] + (p - kept[w][i]))
    return [p.detach().clone() for p in model.parameters()]


def train(groups, sync_every: int, outer_lr: float | None, outer_steps: int, **streaming) -> list:
    """Every group trains ``outer_steps`` committed outer steps; per group: its global model's
    parameters, its digest, the indices it trained on per committed step, and the inner
    steps taken while an outer step's reduction was under way (``delay``)."""
    def run(i: int, g):
        model, algorithm, sampler = make(g, sync_every, outer_lr, **streaming)
        trained: dict[int, list[int]] = {}
        overlapped = 0
        while g.step < outer_steps:
            for indices in sampler:
                buckets = g._loop.ports.collective.buckets
                if algorithm._sent is not None and buckets is not None:  # sent early: the buckets hold it, in flight
                    overlapped += buckets.touched
                inner_step(model, indices)
                if algorithm.step():
                    trained[g.step] = [x for part in sampler.committed_parts for x in sampler.indices(part)]
                if g.step >= outer_steps:
                    break
        return [p.detach().clone() for p in algorithm.model_state().values()], g.state.digest(g.step), trained, \
            overlapped
    return in_threads(groups, run)


@pytest.mark.parametrize("outer_lr,sync_every,streaming", [
    (0.7, 3, {}), (None, 3, {}), (0.7, 4, {"fragments": 2}), (0.7, 4, {"fragments": 2, "quantize": "bf16"}),
    (0.7, 4, {"fragments": 2, "quantize": "int8"}), (0.7, 3, {"quantize": "int8"}), (0.7, 3, {"delay": 2}),
    (0.7, 4, {"fragments": 2, "delay": 1}), (0.7, 4, {"fragments": 2, "quantize": "int8", "delay": 1})],
    ids=["diloco", "local-sgd", "streaming", "streaming-bf16", "streaming-int8", "diloco-int8", "diloco-delay",
         "streaming-delay", "streaming-int8-delay"])
def test_outer_steps_match_the_algorithm_computed_alone_and_consume_every_sample_once(outer_lr, sync_every,
                                                                                     streaming):
    """Two workers, eight outer steps of three inner steps (two epochs of four, the epoch's
    permutation split per inner batch), or with the model in two fragments taking turns
    every two inner steps (Streaming DiLoCo, its pseudo-gradients summed in float32,
    bfloat16 or int8; DiLoCo in int8), or with the outer step's reduction overlapping the
    last inner steps before it (``delay``: sent early, and under way while they train):
    every worker ends with the global model that the algorithm computed alone gives
    (DiLoCo's Nesterov outer step, or LocalSGD's average), the same digest, and every
    sample of each epoch trained on exactly once."""
    groups = start_groups(2)
    try:
        results = train(groups, sync_every, outer_lr, 8, **streaming)
    finally:
        for g in groups:
            g.shutdown()
    fragments, delay = streaming.get("fragments", 1), streaming.get("delay", 0)
    wire = {"bf16": torch.bfloat16, "int8": torch.int8}.get(streaming.get("quantize"))
    expected = reference(2, sync_every, outer_lr, 8, fragments, wire, delay)
    for params, _, _, overlapped in results:
        # every outer step but the first (which builds the buckets and their hooks) sent early
        assert overlapped == (7 * delay if delay else 0)
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
    if wire is not None:  # the sum did travel in bfloat16: float32's result is another
        exact = reference(2, sync_every, outer_lr, 8, fragments, delay=delay)
        assert any((p - e).abs().max() > 1e-4 for p, e in zip(results[0][0], exact))
    if delay:  # the pseudo-gradients were taken early: waiting for the due step gives another model
        assert any((p - e).abs().max() > 1e-4 for p, e in zip(results[0][0], reference(2, sync_every, outer_lr, 8,
                                                                                           fragments, wire)))
    assert len({digest for _, digest, _, _ in results}) == 1
    per_step = sync_every // fragments * BATCH
    for step in range(1, 9):  # each outer step: its inner batches of 8, split over 2 workers
        indices = [i for _, _, trained, _ in results for i in trained[step]]
        epoch, start = divmod((step - 1) * per_step, SAMPLES)
        assert sorted(indices) == sorted(epoch_permutation(SAMPLES, SEED, epoch)[start:start + per_step].tolist())


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_worker_that_leaves_while_its_outer_step_travels_is_not_counted_in_it(fragments):
    """Three workers, each outer step sent two inner steps early (``delay=2``, three inner
    steps per outer step); one leaves after sending one, its last two inner batches
    untrained, once the others took that outer step's last inner step. Its contribution
    must not count: the others discard that outer step and do it again over the two of
    them, so every sample of each epoch is trained on exactly once by committed outer
    steps, and the two end with one digest."""
    groups = start_groups(3)
    at_due = [threading.Event(), threading.Event()]  # the others, at the fourth outer step's wait

    def run(i: int, g):
        model, algorithm, sampler = make(g, 3 * fragments, 0.7, fragments=fragments, delay=2)
        trained: dict[int, list[int]] = {}
        while g.step < 8:
            for indices in sampler:
                inner_step(model, indices)
                if i < 2 and g.step == 3 and sampler.inner_steps_left() == 1:
                    at_due[i].set()  # (the step below is this outer step's last inner step: its wait)
                if algorithm.step():
                    trained[g.step] = [x for part in sampler.committed_parts for x in sampler.indices(part)]
                if i == 2 and g.step == 3 and algorithm.in_flight:  # sent, two inner batches of it untrained
                    wait_until(lambda: all(e.is_set() for e in at_due), 30, "the others at the outer step")
                    g.shutdown()
                    return None, trained
                if g.step >= 8:
                    break
        return g.state.digest(g.step), trained
    try:
        results = in_threads(groups, run)
    finally:
        for g in groups:
            g.shutdown()
    assert results[0][0] == results[1][0] and sorted(results[2][1]) == [1, 2, 3]
    per_step = 3 * BATCH
    for step in range(1, 9):
        indices = [i for _, trained in results for i in trained.get(step, [])]
        epoch, start = divmod((step - 1) * per_step, SAMPLES)
        assert sorted(indices) == sorted(epoch_permutation(SAMPLES, SEED, epoch)[start:start + per_step].tolist()), \
            f"outer step {step}"


@pytest.mark.parametrize("fragments", [1, 2])
def test_workers_with_different_delays_keep_one_global_model(fragments):
    """Each worker may choose its own ``delay`` (one sends its outer steps early, the other
    at the due step): they reduce one layout and end with one global model."""
    groups = start_groups(2)

    def run(i: int, g):
        outer_steps(g, *make(g, 3 * fragments, 0.7, fragments=fragments, delay=i), 4)
        return g.state.digest(g.step)
    try:
        digests = in_threads(groups, run)
    finally:
        for g in groups:
            g.shutdown()
    assert digests[0] == digests[1]


class OneWorker:
    """What DiLoCo and the sampler use of a group, for one worker whose outer steps commit
    or are discarded as scripted (``discards``: True for each sync to discard, in order)."""

    rank, world_size = 0, 1

    def __init__(self, discards: list[bool]) -> None:
        from ftcomm.training.state import TrainingState
        self.discards, self.step, self.state = list(discards), 0, TrainingState()

    def register_state(self, **objects) -> None:
        self.state.register(**objects)
        for obj in self.state.objects.values():
            if hasattr(obj, "bind_group"):
                obj.bind_group(self)

    def step_boundary(self) -> None:
        pass

    def wait_gradients_ready(self, params, wire_dtype=torch.float32, sent_early=False) -> bool:
        sampler = self.state.objects["sampler"]
        sampler.check_step()
        committed = sampler.batch_valid() and not (self.discards and self.discards.pop(0))
        self.step += committed
        sampler.step_ended(committed)
        return committed


@pytest.mark.parametrize("fragments,delay", [(1, 0), (2, 0), (1, 1), (2, 1)],
                         ids=["diloco", "streaming", "diloco-delay", "streaming-delay"])
def test_a_discarded_outer_step_is_done_again_from_the_model_and_the_inner_state_it_started_from(fragments, delay):
    """An outer step discarded (the view changed during it) leaves no trace: the worker goes
    back to the local model of the last outer step (the global model; with two fragments,
    the other fragment's inner steps since its outer step kept; with ``delay``, the inner
    steps the outer step overlapped kept) and to its inner optimizer's momentum then, and
    its inner batches are drawn again; the model after three committed outer steps is bit
    for bit the one of a run where none was discarded."""
    def run(discards: list[bool]) -> tuple[list[torch.Tensor], list[bool]]:
        group = OneWorker(discards)
        model, algorithm, sampler = make(group, 2 * fragments, 0.7, fragments=fragments, delay=delay)
        results = outer_steps(group, model, algorithm, sampler, 3)
        return [p.detach().clone() for p in model.parameters()], results

    plain, plain_results = run([])
    discarded, results = run([False, True, False])
    assert plain_results == [True] * 3 and results == [True, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(plain, discarded))
    twice, results = run([False, True, True, False])  # two in a row: the saved inner state is not the live one
    assert results == [True, False, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(plain, twice))


class Alone:
    """A group of one without a sampler whose outer steps commit; ``during(params)`` runs
    inside each, as a reconcile would."""

    rank, world_size, step = 0, 1, 0

    def __init__(self, during=lambda params: None) -> None:
        self.during = during

    def wait_gradients_ready(self, params, wire_dtype=torch.float32, sent_early=False) -> bool:
        self.during(params)
        self.step += 1
        return True

    def step_boundary(self) -> None:
        pass


def test_a_member_whose_state_is_replaced_during_an_outer_step_takes_the_group_s_fragment_turn():
    """Streaming DiLoCo: a member one outer step behind (its turn is fragment 0, the group's
    fragment 1) has its state replaced inside the step, as a reconcile does, and contributes
    nothing; it reduces the same layout as the others and applies what they sent to the
    group's fragment, ending with their global model and turn."""
    def build(group):
        model, inner, outer = model_and_optimizers(0.7)
        return model, ftcomm.DiLoCo(group, model, inner, outer_optimizer=outer, sync_every=4, fragments=2)

    sent = []
    ahead = Alone(lambda params: sent.append(params[0].grad.clone()))
    model, leader = build(ahead)
    for step in range(4):  # two outer steps: fragments 0 and 1
        inner_step(model, [step, step + 1])
        if step == 2:  # after the first outer step
            behind_state = leader.state_dict()
            behind_state = {**behind_state, "global": {n: t.clone() for n, t in behind_state["global"].items()},
                            "outer": copy.deepcopy(behind_state["outer"])}
        leader.step()
    assert leader.state_dict()["outer_steps"] == 2 and leader.next_fragment == 0

    def replaced(params):
        follower.load_state_dict(behind_state)  # the group's state of outer step 1: fragment 1's turn
        params[0].grad.copy_(sent[1])  # its own share counts as none: the others' sum
    model, follower = build(Alone(replaced))
    inner_step(model, [7, 8])
    follower.step()
    inner_step(model, [9, 10])
    assert follower.step() is True
    assert follower.state_dict()["outer_steps"] == 2
    for name, value in leader.state_dict()["global"].items():
        assert torch.equal(follower.state_dict()["global"][name], value), name


def test_a_whole_job_restart_resumes_at_the_last_outer_step_with_the_global_model_and_outer_state(tmp_path, name):
    """A flash checkpoint holds the global model, the outer optimizer's momentum and the data
    position; a new job restoring it (its model built afresh and trained a little, as a
    restarted worker's would be) resumes at that outer step, its model the global one."""
    (first,) = start_groups(1)
    try:
        model, algorithm, sampler = make(first, 3, 0.7)
        outer_steps(first, model, algorithm, sampler, 2)
        saved = algorithm.state_dict()
        saved = {"global": {k: v.clone() for k, v in saved["global"].items()},
                 "momentum": [s["momentum_buffer"].clone() for s in saved["outer"]["state"].values()],
                 "offset": sampler.offset}
        checkpoints = ftcomm.FlashCheckpointer(first, tmp_path, name=name)
        checkpoints.save()
        checkpoints.close()
    finally:
        first.shutdown()
    (second,) = start_groups(1)
    try:
        model, algorithm, sampler = make(second, 3, 0.7)
        inner_step(model, [0, 1, 2])  # a restarted worker's own first steps, before the restore
        algorithm.inner_optimizer.step()
        checkpoints = ftcomm.FlashCheckpointer(second, tmp_path, name=name)
        assert checkpoints.restore() == 2 and second.step == 2
        checkpoints.close()
        state = algorithm.state_dict()
        assert all(torch.equal(state["global"][k], v) for k, v in saved["global"].items())
        assert all(torch.equal(p, g) for p, g in zip(model.parameters(), state["global"].values()))
        momentum = [s["momentum_buffer"] for s in state["outer"]["state"].values()]
        assert len(momentum) == 2 and all(torch.equal(a, b) for a, b in zip(momentum, saved["momentum"]))
        assert sampler.offset == saved["offset"] == 48
    finally:
        second.shutdown()


def test_a_rewind_keeps_the_inner_learning_rate_the_new_view_set_and_a_frozen_parameter_unfrozen_trains_on():
    """The learning rate a policy set for the new view (LinearLRScaling, at the re-formation)
    survives the discarded step's rewind of the inner optimizer's state; a parameter frozen
    when DiLoCo was made and unfrozen later is averaged like the others, not reset."""
    group = OneWorker([False, True])
    model, inner, _ = model_and_optimizers(None)
    model.bias.requires_grad_(False)
    algorithm = ftcomm.DiLoCo(group, model, inner, outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.7),
                              sync_every=3)
    sampler = ftcomm.ElasticSampler(SAMPLES, global_batch=BATCH, seed=SEED)
    group.register_state(diloco=algorithm, sampler=sampler)
    model.bias.requires_grad_(True)
    frozen = model.bias.detach().clone()
    results = []
    for indices in sampler:
        inner_step(model, indices)
        if sampler._drawn == 2 and len(results) == 1:
            algorithm.inner_optimizer.param_groups[0]["lr"] = 0.1  # a view changed: the policy's new rate
        result = algorithm.step()
        if result is not None:
            results.append(result)
        if len(results) == 3:
            break
    assert results == [True, False, True]
    assert algorithm.inner_optimizer.param_groups[0]["lr"] == 0.1
    assert not torch.equal(model.bias.detach(), frozen)  # trained and averaged, not put back


def test_a_state_that_does_not_fit_is_refused_with_nothing_loaded_and_the_model_is_the_group_s_signature():
    group = OneWorker([])
    model, algorithm, _ = make(group, 3, 0.7)
    good = algorithm.state_dict()
    before = [t.clone() for t in good["global"].values()]
    momentum = {0: {"momentum_buffer": torch.zeros(7)}}
    for bad in (5, {**good, "outer": 5}, {k: v for k, v in good.items() if k != "outer"},
                {**good, "global": {"weight": good["global"]["weight"]}},
                {**good, "global": {**good["global"], "bias": torch.zeros(1, dtype=torch.int64)}},
                {**good, "outer": {**good["outer"], "state": momentum}}, {**good, "sync_every": 4},
                {**good, "fragments": 2}, {**good, "outer_steps": -1}, {**good, "outer_steps": "3"},
                {**good, "other": 1}):
        with pytest.raises(ValueError):
            algorithm.load_state_dict(bad)
        assert all(torch.equal(a, b) for a, b in zip(algorithm.state_dict()["global"].values(), before))
        assert not algorithm.outer_optimizer.state
    # the global model is what the group compares when a worker joins, and bounds a transfer
    assert [entry[0] for entry in group.state.describe()] == ["diloco.weight", "diloco.bias"]
    assert group.state.transfer_limit() >= 1 << 30
    other = OneWorker([])
    torch_model = torch.nn.Linear(4, 2)
    other.register_state(diloco=ftcomm.DiLoCo(other, torch_model, torch.optim.SGD(torch_model.parameters(), lr=0.1),
                                              outer_optimizer=torch.optim.SGD(torch_model.parameters(), lr=0.7),
                                              sync_every=3))
    assert other.state.signature() != group.state.signature()


def test_registering_the_local_model_or_giving_wrong_arguments_is_refused_with_the_reason():
    groups = start_groups(1)
    try:
        g = groups[0]
        model, inner, outer = model_and_optimizers(0.7)
        with pytest.raises(ValueError, match="sync_every"):
            ftcomm.DiLoCo(g, model, inner, outer_optimizer=outer, sync_every=0)
        with pytest.raises(ValueError, match="another optimizer"):
            ftcomm.DiLoCo(g, model, inner, outer_optimizer=inner, sync_every=2)
        other = torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.7)
        with pytest.raises(ValueError, match="not a parameter of the model"):
            ftcomm.DiLoCo(g, model, inner, outer_optimizer=other, sync_every=2)
        for bad, match in (({"sync_every": 4, "fragments": 3}, "divisor"), ({"sync_every": 4, "fragments": 0}, "divisor"),
                           ({"sync_every": 4, "fragments": 4}, "2 parameters"),
                           ({"sync_every": 2, "quantize": "int4"}, "quantize"),
                           ({"sync_every": 4, "fragments": 2, "delay": 2}, "delay"),
                           ({"sync_every": 4, "delay": -1}, "delay"), ({"sync_every": 4, "delay": True}, "delay")):
            with pytest.raises(ValueError, match=match):
                ftcomm.DiLoCo(g, model, inner, outer_optimizer=outer, **bad)
        wrapped = g.wrap(torch.nn.Linear(4, 1))
        with pytest.raises(FtcommError, match="float32"):
            g.wait_gradients_ready(wrapped, wire_dtype=torch.bfloat16)
        diloco = ftcomm.DiLoCo(g, model, inner, outer_optimizer=outer, sync_every=2)
        with pytest.raises(FtcommError, match="not its model"):
            g.register_state(model=model, diloco=diloco)
    finally:
        for g in groups:
            g.shutdown()


def test_a_joiner_receives_the_global_model_and_outer_state_and_enters_at_an_outer_boundary():
    """Two workers train; a third registers mid-interval. It is admitted only at an outer
    boundary (the running ones never discard an outer step for it: no view changes between
    their inner steps), and starts its inner steps from the global model and the outer
    optimizer's momentum, not from a member's drifted model; at every outer step after,
    all three hold one digest."""
    groups = start_groups(2)
    joiner = None
    target = [10**9]
    digests: list[dict] = [{}, {}, {}]
    discarded: list[str] = []  # the reason of the latest view change when a running member discarded

    def run(i: int, g, setup=None) -> None:
        model, algorithm, sampler = setup or make(g, 4, 0.7)
        while g.step < target[0]:
            for indices in sampler:
                inner_step(model, indices)
                committed = algorithm.step()
                if committed:
                    digests[i][g.step] = g.state.digest(g.step)
                elif committed is False and i < 2:
                    discarded.append(g.events[-1].reason)
                if g.step >= target[0]:
                    break
    try:
        runner = threading.Thread(target=lambda: in_threads(groups, run), daemon=True)
        runner.start()
        wait_until(lambda: min(g.step for g in groups) >= 3, 60, "the two workers training")
        joiner = join_running(groups)
        setup = make(joiner, 4, 0.7)  # admitted here, at the group's next outer boundary
        model, algorithm, _ = setup
        assert all(torch.equal(p, g) for p, g in zip(model.parameters(), algorithm._global))
        assert algorithm.state_dict()["outer"]["state"], "the outer optimizer's momentum came with the state"
        target[0] = joiner.step + 3
        run(2, joiner, setup)
        runner.join(60)
        assert not runner.is_alive()
    finally:
        target[0] = 0
        for g in [*groups, *([joiner] if joiner else [])]:
            g.shutdown()
    assert "join" not in discarded, discarded
    assert len(digests[2]) >= 3
    for step, digest in digests[2].items():
        assert digests[0][step] == digests[1][step] == digest, f"outer step {step}"


def test_a_partition_kill_9_a_hang_and_a_joiner_during_diloco_training_lose_no_sample_and_leave_one_global_model(
        cluster):
    """Four workers of the example in Streaming DiLoCo mode (two fragments taking turns every
    2 inner steps, pseudo-gradients in bfloat16; one fragment runs the same code): a 2|2
    partition (only rank 0's side commits outer steps; the other goes on with inner steps
    alone) healed, kill -9 of one, SIGSTOP of another across outer boundaries (resumed, it
    rejoins), then a new worker joins. Every view holds one global model, every worker ends
    with one digest, and every sample of each epoch was trained on exactly once by committed
    outer steps."""
    args = ["--min-workers", "1", "--sync-every", "4", "--fragments", "2", "--quantize", "bf16", "--log-indices"]
    workers = cluster.start(4, args)
    views = cluster.wait_view(workers, 4, timeout=60)
    last = max(v["view_id"] for v in views)
    order = {m: i for i, m in enumerate(max(views, key=lambda v: v["view_id"])["members"])}
    workers.sort(key=lambda w: order[w.id])  # by rank: rank 0's side holds the tie
    for w in workers:
        w.send(cmd="partition", a=[w.address for w in workers[:2]], b=[w.address for w in workers[2:]])
    last = max(v["view_id"] for v in cluster.wait_view(workers[:2], 2, timeout=30, after=last))
    cut_off = [cluster.status(w) for w in workers[2:]]
    going = [cluster.status(w) for w in workers[:2]]
    wait_until(lambda: min(cluster.status(w) for w in workers[:2]) > max(going) + 5, 30, "rank 0's side committing")
    assert [cluster.status(w) for w in workers[2:]] == cut_off, "the side without rank 0 committed an outer step"
    for w in workers:
        w.send(cmd="heal")
    last = max(v["view_id"] for v in cluster.wait_view(workers, 4, timeout=60, after=last))
    workers[3].signal(signal.SIGKILL)
    last = max(v["view_id"] for v in cluster.wait_view(workers[:3], 3, timeout=30, after=last))
    workers[2].signal(signal.SIGSTOP)
    last = max(v["view_id"] for v in cluster.wait_view(workers[:2], 2, timeout=30, after=last))
    cluster.status(workers[0])
    workers[2].signal(signal.SIGCONT)
    reasons = _join_finish_and_check(cluster, args, workers, workers[:3], last)
    # (a kill -9 between outer steps, while no collective is open to the worker, is found by
    # gossip's probes, which cannot tell it from a hang: the reason is then "hang")
    faults = [r for r in reasons if r in ("crash", "hang")]
    assert reasons[:1] == ["init"] and {"partition", "hang", "join"} <= set(reasons) and len(faults) >= 2, reasons


def test_a_kill_9_and_a_hang_while_an_outer_step_travels_during_inner_steps_lose_no_sample_and_leave_one_model(
        cluster):
    """Streaming DiLoCo whose outer steps overlap inner steps (two fragments taking turns
    every 4 inner steps, each outer step's float32 reduction sent 3 inner steps before it
    is due, so it is most often complete before then; its counters wait for the due step):
    three workers; one kills itself (SIGKILL) right after an inner step during which
    its outer step's reduction was under way, another stops itself (SIGSTOP) there and is
    resumed later (it rejoins), then a worker joins. Every worker ends with one digest,
    and every sample of each epoch was trained on exactly once by committed outer steps."""
    args = ["--min-workers", "1", "--sync-every", "8", "--fragments", "2", "--delay", "3", "--log-indices"]
    workers = cluster.start(3, args)
    last = max(v["view_id"] for v in cluster.wait_view(workers, 3, timeout=60))
    going = [cluster.status(w) for w in workers]
    wait_until(lambda: min(cluster.status(w) for w in workers) > max(going) + 3, 30, "outer steps committing")
    workers[2].send(cmd="in_flight", signal="KILL")
    workers[2].wait_for(lambda e: e["ev"] == "in_flight", 30, "the kill while a reduction travels")
    last = max(v["view_id"] for v in cluster.wait_view(workers[:2], 2, timeout=30, after=last))
    going = cluster.status(workers[0])
    wait_until(lambda: cluster.status(workers[0]) > going + 3, 30, "the survivors committing")
    workers[1].send(cmd="in_flight", signal="STOP")
    workers[1].wait_for(lambda e: e["ev"] == "in_flight", 30, "the stop while a reduction travels")
    last = max(v["view_id"] for v in cluster.wait_view(workers[:1], 1, timeout=30, after=last))
    cluster.status(workers[0])
    workers[1].signal(signal.SIGCONT)
    reasons = _join_finish_and_check(cluster, args, workers, workers[:2], last)
    assert reasons[:1] == ["init"] and "join" in reasons and \
        len([r for r in reasons if r in ("crash", "hang")]) >= 2, reasons


def _join_finish_and_check(cluster, args: list[str], workers: list, alive: list, last_view: int) -> list[str]:
    """A worker joins ``alive``; all of them stop at one step: one digest, every sample of each
    epoch trained on exactly once by committed outer steps (``workers``' logs, the dead
    ones' included). The view reasons rank 0 saw."""
    from benchmarks.convergence import check_exactly_once

    joiner = cluster.start(1, args)
    live = [*alive, *joiner]
    cluster.wait_view(live, len(live), timeout=60, after=last_view)
    done = cluster.finish(live)
    assert_invariants(live, done)
    logs = [[e for e in w.snapshot() if e["ev"] == "batch"] for w in [*workers, *joiner]]
    once = check_exactly_once(logs, done[0]["step"], samples=8192, seed=0)
    assert once["ok"], once["problems"]
    return [e["reason"] for e in workers[0].snapshot() if e["ev"] == "view"]

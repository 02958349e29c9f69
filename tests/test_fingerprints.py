"""Silent data corruption: a bit flipped in one member's parameters, optimizer state or
reduced gradient is caught by the fingerprint comparison, the member named and repaired
from the majority, and training ends exactly where a run without the flip ends."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import ftcomm
from ftcomm.core.engine import fingerprint_verdict, reconcile_source
from ftcomm.runtime.fingerprints import FingerprintCheck
from tests.test_group_threads import in_threads, start_groups

pytestmark = pytest.mark.timeout(180)

EVERY = 2


def flip_bit(tensor: torch.Tensor, index: int = 3, bit: int = 20) -> None:
    """Flip one bit of one element of a float32 tensor, in place (what a faulty memory cell does)."""
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[index] ^= 1 << bit


def models_for(groups, seed: int = 0) -> tuple[list, list]:
    models, optimizers = [], []
    for g in groups:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        g.register_state(model=model, optimizer=optimizer)
        models.append(model)
        optimizers.append(optimizer)
    return models, optimizers


@contextlib.contextmanager
def members(n: int, **options):
    """``n`` members (threads) with a model and an optimizer each; shut down at the end."""
    groups = start_groups(n, fingerprint_every=EVERY, **options)
    try:
        yield (groups, *models_for(groups))
    finally:
        for g in groups:
            g.shutdown()


def train(groups, models, optimizers, until: int, corrupt=None) -> None:
    """Train every member to committed step ``until``; each member's batch depends only on
    the step and its rank, so a step redone after a discard computes the same update. The
    step boundary comes first (as an ElasticSampler's batch does): a member repaired there
    computes its gradient on the repaired state, so it counts.
    ``corrupt(i, group, where)`` is called at each point where a fault may strike: ``state``
    between steps, ``gradient`` after the reduction and before the optimizer steps."""
    in_threads(groups, lambda i, g: train_one(g, models[i], optimizers[i], until,
                                              corrupt and (lambda g, where: corrupt(i, g, where))))


def train_one(g: ftcomm.FaultTolerantGroup, m, o, until: int, corrupt=None) -> None:
    """One member's loop of :func:`train` (``corrupt(group, where)``)."""
    while g.step < until:
        if corrupt is not None:
            corrupt(g, "state")
        g.step_boundary()  # a repair due is done here, before the step is computed on a wrong state
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * g.step + g.rank))
        m(x).pow(2).sum().backward()
        if g.wait_gradients_ready(m):
            if corrupt is not None:
                corrupt(g, "gradient")
            o.step()
        o.zero_grad()


def reference_digest(steps: int) -> int:
    """The state digest three members reach without any corruption."""
    with members(3) as (groups, models, optimizers):
        train(groups, models, optimizers, steps)
        digests = {g.state.digest(g.step) for g in groups}
        assert len(digests) == 1 and not any(g.corruptions for g in groups)
        return digests.pop()


@pytest.mark.parametrize("place", ["parameter", "optimizer moment", "reduced gradient"])
def test_a_bit_flipped_in_one_member_is_caught_named_repaired_and_training_ends_as_without_it(place):
    steps = 12
    expected = reference_digest(steps)
    with members(3) as (groups, models, optimizers):
        victim = groups[1].id
        struck = {}

        def corrupt(i: int, g, where: str) -> None:
            # at a step whose state the next step's fingerprints are of: the step carrying the
            # fault (and the gradient computed on it) is discarded, so nothing of it remains
            if g.id != victim or struck or g.step != 6:
                return
            if place == "parameter" and where == "state":
                flip_bit(models[i][0].weight)
            elif place == "optimizer moment" and where == "state":
                flip_bit(optimizers[i].state[models[i][2].weight]["exp_avg"])
            elif place == "reduced gradient" and where == "gradient":
                flip_bit(models[i][2].weight.grad)  # this member steps with a wrong average
            else:
                return
            struck["at"] = g.step
        train(groups, models, optimizers, steps, corrupt)
        assert struck, "the fault was never injected"
        for g in groups:
            (found,) = g.corruptions  # caught once, by every member alike
            assert found.named == (victim,) and found.majority and found.shard is None
            assert found.step == 6  # the state the next step's fingerprints were of
        (named,) = groups[1].corruptions
        wrong = {"parameter": {"model.0.weight"}, "optimizer moment": {"optimizer.state.2.exp_avg"}}.get(place)
        if wrong is not None:
            assert set(named.tensors) == wrong, named.tensors
        else:  # a wrong gradient moved the weight and the optimizer's moments of that tensor
            assert "model.2.weight" in named.tensors, named.tensors
        # repaired: every member ends bit for bit where a run without the flip ends
        assert [g.state.digest(g.step) for g in groups] == [expected] * 3


def test_two_members_that_disagree_stop_naming_both_and_the_last_step_they_agreed_on():
    with members(2) as (groups, models, optimizers):
        train(groups, models, optimizers, 4)
        flip_bit(models[0][0].bias, index=1)

        def step(i: int, g) -> str:
            try:
                train_one(g, models[i], optimizers[i], 6)
            except ftcomm.StateDiverged as exc:
                return str(exc), exc.named
            return "", ()
        results = in_threads(groups, step)
        for text, named in results:
            assert set(named) == {g.id for g in groups}
            assert "no fingerprint has a majority" in text and "every fingerprint agreed: 2;" in text, text


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_the_policy_warn_only_names_and_stop_stops_every_member(policy):
    with members(3, sdc_policy=policy) as (groups, models, optimizers):
        train(groups, models, optimizers, 2)
        flip_bit(models[2][2].weight)

        def run(i: int, g):
            try:
                train_one(g, models[i], optimizers[i], 6)
            except ftcomm.StateDiverged as exc:
                return exc
            return None
        outcomes = in_threads(groups, run)
        if policy == "warn":
            assert outcomes == [None, None, None] and [g.step for g in groups] == [6, 6, 6]
            assert all(g.corruptions and g.corruptions[0].named == (groups[2].id,) for g in groups)
            assert len({g.state.digest(6) for g in groups}) == 2  # named, never repaired
        else:
            assert all(isinstance(o, ftcomm.StateDiverged) and o.named == (groups[2].id,) for o in outcomes)
            assert [g.step for g in groups] == [2, 2, 2]  # the step that found it was not committed


def test_a_member_named_again_soon_after_its_repair_leaves_and_the_others_go_on():
    with members(3) as (groups, models, optimizers):
        victim = groups[0].id
        struck = []

        def corrupt(g, where: str) -> None:
            if g.id == victim and where == "state" and g.step in (4, 6) and g.step not in struck:
                struck.append(g.step)
                flip_bit(models[0][0].weight, index=len(struck))

        def run(i: int, g):
            try:
                train_one(g, models[i], optimizers[i], 10, corrupt)
            except ftcomm.StateDiverged as exc:
                # it has left: a script that carries on (as fault-tolerant loops do) gets a clear error
                with pytest.raises(ftcomm.FtcommError, match="shut down"):
                    train_one(g, models[i], optimizers[i], 10)
                return exc
            return None
        outcomes = in_threads(groups, run)
        assert isinstance(outcomes[0], ftcomm.StateDiverged) and "leaves the group" in str(outcomes[0])
        assert outcomes[0].leaves
        assert outcomes[1:] == [None, None]
        assert [g.step for g in groups[1:]] == [10, 10]
        assert groups[1].world_size == 2 and victim not in groups[1].view.members
        assert groups[1].state.digest(10) == groups[2].state.digest(10)


# ---------------------------------------------------------------------- the rules alone
def test_the_verdict_names_the_minority_or_everyone_without_a_majority():
    assert fingerprint_verdict([5, 5, 5]) is None
    assert fingerprint_verdict([5, None, None]) is None  # one fingerprint: nothing to compare
    assert fingerprint_verdict([5, 7, 5, None]) == ((1,), 3, True)
    assert fingerprint_verdict([5, 7]) == ((0, 1), 2, False)
    assert fingerprint_verdict([5, 7, 9]) == ((0, 1, 2), 3, False)
    assert fingerprint_verdict([5, 5, 7, 7]) == ((0, 1, 2, 3), 4, False)


def test_a_reconcile_takes_the_fingerprint_most_holders_of_the_newest_step_share():
    # (step, digest, fingerprint): the digests differ by rank (buffers); the fingerprints decide
    assert reconcile_source([(4, 1, 7), (4, 2, 5), (4, 3, 5)]) == 1  # rank 0's state went wrong: not the source
    assert reconcile_source([(4, 1, 7), (4, 2, 5)]) == 0  # no majority: the lowest rank, as before
    assert reconcile_source([(3, 9, 1), (4, 1, 7), (4, 2, 5), (4, 3, 5)]) == 2
    assert reconcile_source([(4, 1), (4, 2)]) == 0 and reconcile_source([(4, 1, -1), (4, 2, -1)]) == 0  # none given
    assert reconcile_source([(4, 1, 7), (4, 1, 7)]) is None
    # (…, lineage): holders of one step from two lineages (two sides of a partition) differ by
    # design; the lowest rank's lineage is handed on, of it the majority's fingerprint
    assert reconcile_source([(4, 1, 7, 100), (4, 2, 5, 200), (4, 3, 5, 200)]) == 0
    assert reconcile_source([(4, 1, 7, 100), (4, 2, 5, 100), (4, 3, 5, 100), (4, 4, 9, 200)]) == 1


def test_every_process_of_sharded_replicas_takes_the_most_severe_action_any_shard_index_asks_for():
    """2 replicas of 2 (a0 a1 b0 b1): only shard 1's fingerprints differ, without a majority
    (two replicas); and 3 replicas where one just received its state and gave none. Each
    process judges its own shard index's fingerprints, the actions are summed over the view
    (as _replica_verdict does), and every process decides alike."""
    from ftcomm.core import engine as core
    from ftcomm.core.view import View
    from ftcomm.options import GroupOptions
    from ftcomm.runtime.ports import Counters
    from tests.conftest import status
    from tests.fakeports import world_for

    def decisions(replicas: str, prints: dict[int, tuple], policy: str) -> dict[str, str]:
        members = tuple(f"{r}{s}" for r in replicas for s in (0, 1))
        statuses = {m: status(m, cv=2, replica=(m[0].upper(), int(m[1]), 2)) for m in members}
        worlds = {}
        for m in members:
            world = world_for(m, statuses, GroupOptions(leave_grace=0.5, sdc_policy=policy), replica=(m[0].upper(), int(m[1]), 2))
            world.engine.view, world.engine.state, world.loop.step = View(2, members), core.RUNNING, 10
            worlds[m] = world
        reduced = {m: Counters(2.0, 0.0, (), prints[int(m[1])]) for m in members}
        local = {m: worlds[m].loop._local_action(reduced[m])[0] for m in members}
        actions = tuple(sum(1 for s in (0, 1) if local[f"{replicas[0]}{s}"] == a) for a in ("repair", "again", "stop"))
        out = {}
        for m in members:
            try:
                out[m] = worlds[m].loop._judge_fingerprints(reduced[m], reduced[m]._replace(actions=actions))
            except ftcomm.StateDiverged:
                out[m] = "stop"
        return out
    two = decisions("ab", {0: (5, 5), 1: (5, 6)}, "exclude")
    assert set(two.values()) == {"stop"}, two
    three = decisions("abc", {0: (5, 5, 5), 1: (5, 6, None)}, "exclude")
    assert set(three.values()) == {"again"}, three
    repaired = decisions("abc", {0: (5, 5, 5), 1: (5, 6, 6)}, "exclude")
    assert set(repaired.values()) == {"repair"}, repaired
    assert set(decisions("abc", {0: (5, 5, 5), 1: (5, 6, None)}, "stop").values()) == {"again"}


def test_a_step_computed_again_for_a_missing_fingerprint_stops_the_second_time():
    from ftcomm.core.engine import Divergence
    from ftcomm.runtime.fingerprints import step_action

    split = Divergence((0, 1), 2, False)
    assert step_action(split, "exclude", complete=False, again_before=False) == "again"
    assert step_action(split, "exclude", complete=False, again_before=True) == "stop"
    assert step_action(split, "exclude", complete=True, again_before=False) == "stop"
    assert step_action(split, "warn", complete=True, again_before=False) == "commit"
    assert step_action(Divergence((2,), 3, True), "exclude", True, False) == "repair"
    assert step_action(Divergence((2,), 3, True), "stop", True, False) == "stop"
    assert step_action(None, "stop", True, False) == "commit"


def test_a_check_is_due_every_n_committed_steps_and_off_at_zero():
    check = FingerprintCheck(10)
    assert [s for s in range(35) if check.due(s)] == [10, 20, 30]
    assert not any(FingerprintCheck(0).due(s) for s in range(100))


def test_a_state_damaged_on_its_way_to_a_joiner_is_never_trained_on(monkeypatch, caplog):
    """The first state a joiner receives has one bit flipped after it arrived (on the wire,
    or in the joiner's memory while it was loaded): its digest is not the one the source
    showed, so the reconcile fails and the view is agreed again; the next transfer is
    whole, and the joiner trains on the group's state."""
    from ftcomm.training.state import TrainingState
    from tests.test_group_threads import join_running

    unpack = TrainingState.unpack
    damaged = []

    def unpack_and_damage(self, manifest, data):
        step = unpack(self, manifest, data)
        if not damaged:
            damaged.append(step)
            flip_bit(self.objects["model"][0].weight)
        return step
    with members(2) as (groups, models, optimizers):
        train(groups, models, optimizers, 3)
        joiner = join_running(groups, fingerprint_every=EVERY)
        try:
            monkeypatch.setattr(TrainingState, "unpack", unpack_and_damage)
            everyone = [*groups, joiner]

            def run(i: int, g) -> None:
                if g is joiner:  # registered while the others train: it is let in at a step boundary
                    (model,), (optimizer,) = models_for([joiner], seed=1)
                    models.append(model)
                    optimizers.append(optimizer)
                    train_one(g, model, optimizer, 30)
                else:
                    train_one(g, models[i], optimizers[i], 30)
            with caplog.at_level("WARNING"):
                in_threads(everyone, run)
            assert damaged, "no state was received"
            assert "does not match the digest it showed" in caplog.text
            assert len({g.state.digest(g.step) for g in everyone}) == 1 and joiner.step == 30
        finally:
            joiner.shutdown()


def test_ftcomm_members_and_the_status_record_show_a_member_whose_state_was_named():
    from ftcomm.core.view import StatusRecord
    from ftcomm.gossip.runtime import Member
    from ftcomm.ops.cli import _member_table

    record = StatusRecord("active", 3, None, 1.0, "cf", 40, 5000, diverged=(2, 30)).encode()
    assert record["sd"] == [2, 30] and "sd" not in StatusRecord("active", 3, None, 1.0, "cf", 40, 5000).encode()
    table = _member_table([Member("a:1/x", "a", 1, "alive", 0, record),
                           Member("b:1/x", "b", 1, "alive", 0, {**record, "sd": ["\x1b[2J", 1]})])
    rows = {line.split()[0]: line for line in table.splitlines()[1:3]}
    assert "state_diverged=2x!(step 30)" in rows["a:1/x"] and "state_diverged" not in rows["b:1/x"]
    assert table.splitlines()[-1].startswith("! state_diverged") and "\x1b" not in table


def test_checkpoints_made_after_the_last_step_all_agreed_are_not_restored_once_nobody_can_tell_who_is_right(
        tmp_path):
    """Two members checkpoint every step; at step 5 one member's bias has a bit flipped; the
    check of step 6 finds the two fingerprints apart and nobody can tell which is right:
    both raise StateDiverged, and the writers delete their checkpoints after step 4, the
    last step whose fingerprints agreed, so a restart restores step 4."""
    from ftcomm.training.checkpoint import FlashCheckpointer
    from ftcomm.training.checkpoint_files import steps_in

    name = f"test-sdc-{tmp_path.name[-12:]}"
    with members(2) as (groups, models, optimizers):
        checkpoints = [FlashCheckpointer(g, tmp_path / f"dir{i}", keep=10, name=name, shm_root=tmp_path / f"shm{i}")
                       for i, g in enumerate(groups)]
        for c in checkpoints:
            c.is_writer = lambda: True  # two hosts: each member writes its own copies

        def run(i: int, g):
            def corrupt(g, where: str) -> None:
                if where == "state" and i == 0 and g.step == 5 and not getattr(g, "_flipped", False):
                    g._flipped = True
                    flip_bit(models[0][0].bias, index=1)
            try:
                while g.step < 8:
                    train_one(g, models[i], optimizers[i], g.step + 1, corrupt)
                    checkpoints[i].save()
            except ftcomm.StateDiverged as exc:
                checkpoints[i].wait()
                return exc
        outcomes = in_threads(groups, run)
        assert all(isinstance(o, ftcomm.StateDiverged) for o in outcomes), outcomes
        for c in checkpoints:
            assert c.available() == [4, 3, 2, 1]
            assert steps_in(c.directory) == [4, 3, 2, 1]
            c.close()


def batch_norm_models(groups) -> tuple[list, list]:
    """A model with a batch norm (running statistics: buffers that differ by rank) and Adam per member."""
    models, optimizers = [], []
    for g in groups:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        g.register_state(model=model, optimizer=optimizer)
        models.append(model)
        optimizers.append(optimizer)
    return models, optimizers


def test_buffers_that_differ_by_rank_are_no_corruption():
    """A batch norm's running statistics come from each member's own batches, so they
    differ by rank (ftcomm averages gradients, not buffers): the fingerprints leave buffers
    out, and three members train 12 steps, checked every 2, with no member named."""
    with members(3) as (groups, _, _):
        models, optimizers = batch_norm_models(groups)
        train(groups, models, optimizers, 12)
        assert not any(g.corruptions for g in groups) and [g.step for g in groups] == [12] * 3
        assert len({m[1].running_mean.sum().item() for m in models}) == 3  # the buffers do differ


def test_the_repair_of_rank_0_takes_a_majority_member_s_state_though_the_buffers_differ_by_rank():
    """A batch-norm model (its running statistics differ by rank, so the state digests never
    agree): rank 0's weight has a bit flipped at step 6. The repair's source is a member of
    the fingerprints' majority, never the named rank 0: rank 0 receives a state that differs
    from its own in the flipped tensor alone, the others keep theirs, and every member ends
    with one fingerprint. (Batch norm's backward on CPU sums in an order that depends on
    the threads at hand, so runs are not compared bit for bit with one without the flip.)"""
    with members(3) as (groups, _, _):
        models, optimizers = batch_norm_models(groups)
        victim = next(g for g in groups if g.rank == 0)
        healthy = {}

        def corrupt(i: int, g, where: str) -> None:
            if where == "state" and g.step == 6 and not g.corruptions:
                healthy.setdefault(g.id, g.state.fingerprint())
                if g is victim and "flipped" not in healthy:
                    healthy["flipped"] = True
                    flip_bit(models[i][0].weight)
        train(groups, models, optimizers, 10, corrupt)
        assert all(g.corruptions and g.corruptions[0].named == (victim.id,) for g in groups)
        assert victim.corruptions[0].tensors == ("model.0.weight",)  # it took the others' state
        assert all(not c.tensors for g in groups if g is not victim for c in g.corruptions)  # they kept theirs
        assert len({healthy[g.id] for g in groups if g is not victim}) == 1
        assert len({g.state.fingerprint() for g in groups}) == 1


def test_two_holders_that_disagree_when_a_worker_joins_stop_instead_of_handing_on_rank_0_s_state():
    """No comparison is due (fingerprint_every 100); rank 0's weight goes wrong, then a
    worker joins: the reconcile finds the two holders of the newest step apart with no
    majority, and every member stops instead of giving rank 0's state to the others."""
    from tests.test_group_threads import join_running

    # Neither holder may go on alone: a loaded machine's false hang verdict would otherwise
    # let one train past the other, which then takes the newer state (no two holders meet).
    groups = start_groups(2, fingerprint_every=100, min_workers=2)
    joiner = None
    try:
        models, optimizers = models_for(groups)
        train(groups, models, optimizers, 3)
        flip_bit(models[next(i for i, g in enumerate(groups) if g.rank == 0)][0].weight)
        joiner = join_running(groups, fingerprint_every=100, min_workers=2)

        def run(i: int, g):
            try:
                if g is joiner:
                    (model,), (optimizer,) = models_for([joiner], seed=1)
                    train_one(g, model, optimizer, 20)
                else:
                    # The holders step on until they meet the joiner: on a loaded machine
                    # its news may reach them only after they trained to any fixed step, and
                    # then nobody ever compares (the joiner then times out unadmitted).
                    deadline = time.monotonic() + 40
                    while time.monotonic() < deadline:
                        train_one(g, models[i], optimizers[i], g.step + 1)
            except ftcomm.StateDiverged as exc:
                return exc
            return None
        outcomes = in_threads([*groups, joiner], run)
        assert all(isinstance(o, ftcomm.StateDiverged) and "no fingerprint has a majority" in str(o)
                   for o in outcomes[:2]), outcomes
    finally:
        for g in [*groups, joiner]:
            if g is not None:
                g.shutdown()


def test_a_parameter_that_views_its_storage_at_an_odd_offset_is_fingerprinted():
    with members(2) as (groups, _, _):
        models, optimizers = [], []
        for g in groups:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 3))
            # one float into its storage: no 8-byte word starts where the weight does
            model[1].weight = torch.nn.Parameter(torch.randn(64)[1:49].view(3, 16))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            g.register_state(model=model, optimizer=optimizer)
            models.append(model)
            optimizers.append(optimizer)
        assert models[0][1].weight.storage_offset() == 1
        train(groups, models, optimizers, 6)
        assert [g.step for g in groups] == [6, 6] and not any(g.corruptions for g in groups)

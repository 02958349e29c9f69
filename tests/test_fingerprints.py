"""Silent data corruption: a bit flipped in one member's parameters, optimizer state or
reduced gradient is caught by the fingerprint comparison, the member named and repaired
from the majority, and training ends exactly where a run without the flip ends."""

from __future__ import annotations

import contextlib

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
                g.shutdown()
                return exc
            return None
        outcomes = in_threads(groups, run)
        assert isinstance(outcomes[0], ftcomm.StateDiverged) and "leaves the group" in str(outcomes[0])
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


def test_a_reconcile_takes_the_state_most_holders_of_the_newest_step_share():
    assert reconcile_source([(4, 1), (4, 2), (4, 2)]) == 1  # rank 0's state went wrong: not the source
    assert reconcile_source([(4, 1), (4, 2)]) == 0  # no majority: the lowest rank, as before
    assert reconcile_source([(3, 9), (4, 1), (4, 2), (4, 2)]) == 2
    assert reconcile_source([(4, 1), (4, 1)]) is None


def test_a_check_is_due_every_n_committed_steps_and_off_at_zero():
    check = FingerprintCheck(10, "exclude")
    assert [s for s in range(35) if check.due(s)] == [10, 20, 30]
    assert not any(FingerprintCheck(0, "exclude").due(s) for s in range(100))


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
        joiner = join_running(groups)
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


def test_buffers_that_differ_by_rank_are_no_corruption():
    """A batch norm's running statistics come from each member's own batches, so they
    differ by rank (ftcomm averages gradients, not buffers): the fingerprints leave buffers
    out, and three members train 12 steps, checked every 2, with no member named."""
    with members(3) as (groups, _, _):
        models, optimizers = [], []
        for g in groups:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            g.register_state(model=model, optimizer=optimizer)
            models.append(model)
            optimizers.append(optimizer)
        train(groups, models, optimizers, 12)
        assert not any(g.corruptions for g in groups) and [g.step for g in groups] == [12] * 3
        assert len({m[1].running_mean.sum().item() for m in models}) == 3  # the buffers do differ

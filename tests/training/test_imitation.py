"""Imitation before PPO: the actors fitted to the analytic controller decide as it does, the imitated pair is
the first export candidate, the teacher follows each episode's cost profile, and the validation summary
names the winner (tiny pair)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.control import StaticController
from engine.costs.observation import device_features
from engine.costs.speedup_model import SIZE_LADDER
from envs.backends import ReplayBackend
from envs.environments import EnvConfig
from envs.profiles import ProfileMix
from envs.replay import replay_cycles
from policies.analytic import AnalyticController
from training import train_data
from training.imitation import FollowingTeacher, collect, ladder_index
from training.ppo import CoTrainer
from training.ppo_config import PPOConfig
from training.train_config import QUICK, QUICK_PPO, TrainConfig

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """Chain traces and a quick profile of the tiny pair (recorded once for the module)."""
    tmp = tmp_path_factory.mktemp("imitation")
    config = TrainConfig(
        **{**QUICK, "max_new_tokens": 48, "train_prompts": 2},
        pair="tiny",
        cache_dir=str(tmp / "cache"),
        run_dir=str(tmp / "runs"),
        progress=False,
        languages="it,en",
        ppo=PPOConfig(**QUICK_PPO),
    )
    pair = train_data.load_models(config)
    profile = train_data.ensure_profile(config, pair)
    train_prompts, val_prompts = train_data.select_prompts(config)
    return {
        "config": config,
        "profile": profile,
        "train": train_data.ensure_traces(config, pair, train_prompts, "train"),
        "val": train_data.ensure_traces(config, pair, val_prompts, "val"),
    }


def analytic_for(config):
    return lambda profile: AnalyticController(profile, config.tree_width, config.max_depth)


def decisions(controller, traces, profile):
    """Every (kind, answer) the controller gives on the traces, in order (depth-0 questions included)."""
    out = []
    for rt in traces:
        controller.reset()
        loop, reply = replay_cycles(rt, profile, depth_zero=True), None
        while True:
            try:
                kind, payload = loop.send(reply)
            except StopIteration:
                break
            if kind == "depth":
                reply = bool(controller.should_continue(payload))
            elif kind == "size":
                reply = int(controller.num_to_verify(payload))
            else:
                reply = None
                controller.observe(payload)
                continue
            out.append((kind, reply))
    return out


def agreement(a, b) -> float:
    """Share of equal answers over the common prefix of two decision sequences (they diverge once a
    decision differs, so the prefix up to the first divergence per trace is what the comparison sees)."""
    n = min(len(a), len(b))
    return float(np.mean([x == y for x, y in zip(a[:n], b[:n])])) if n else 0.0


def tiny_trainer(tiny_data, ppo, evaluate=None) -> CoTrainer:
    """A trainer on the tiny traces (static (1, 1) baseline, depth 0 decided)."""
    config, profile = tiny_data["config"], tiny_data["profile"]
    return CoTrainer(
        ReplayBackend(tiny_data["train"], profile),
        ppo,
        EnvConfig(depth_zero=True),
        lambda: StaticController(1, 1, tree_width=config.tree_width),
        evaluate,
        max_depth=config.max_depth,
        device_feats=device_features(profile, config.tree_width),
        seed=0,
    )


def test_ladder_index_maps_a_size_to_the_action_that_verifies_it():
    assert [ladder_index(s, SIZE_LADDER) for s in (1, 2, 4, 6, 64)] == [0, 1, 3, 4, 11]
    # a size the ladder lacks (the nodes drafted, 5): the first entry above it, which the cap brings to 5
    assert SIZE_LADDER[ladder_index(5, SIZE_LADDER)] == 6
    assert ladder_index(100, SIZE_LADDER) == len(SIZE_LADDER) - 1


def test_imitated_actors_decide_as_the_analytic_controller_and_are_the_first_candidate(tiny_data):
    config, profile = tiny_data["config"], tiny_data["profile"]
    ppo = PPOConfig(**{**QUICK_PPO, "imitation_steps": 3000, "imitation_epochs": 20})
    trainer = tiny_trainer(tiny_data, ppo, train_data.replay_eval(tiny_data["val"], profile))
    untrained = tiny_trainer(tiny_data, ppo)
    log = trainer.imitate(analytic_for(config))
    assert log.policy == "imitation" and log.steps >= 2 * 3000 and len(log.validation) == 1
    assert trainer.history == [log]
    assert trainer.imitation["size"]["agreement"] >= 0.9 and trainer.imitation["depth"]["agreement"] >= 0.9
    # the imitated pair is the first export candidate, with its validation figure
    assert trainer.best[1] is not None and trainer.best[0] == log.validation[0][1]

    analytic = AnalyticController(profile, config.tree_width, config.max_depth)
    teacher = decisions(analytic, tiny_data["val"], profile)
    learned = decisions(trainer.joint(), tiny_data["val"], profile)
    assert agreement(teacher, learned) >= 0.85  # held-out prompts: the fit generalises
    # negative control: actors that were never fitted (random networks) do not decide as the teacher does
    for name in ("size", "depth"):
        venv = untrained._make_venv(name, untrained.baseline)
        untrained.models[name] = untrained._new_model(name, venv)
    assert agreement(teacher, decisions(untrained.joint(), tiny_data["val"], profile)) < 0.85
    # and the imitated controller's throughput is the teacher's, within a few percent
    teacher_tps = train_data.replay_eval(tiny_data["val"], profile)(analytic)
    assert trainer.best[0] == pytest.approx(teacher_tps, rel=0.05)
    trainer.close()
    untrained.close()


def test_imitation_collects_the_same_decisions_in_worker_processes(tiny_data):
    """The two policies' teacher decisions are collected at once in two worker processes
    (``training.vec_workers.WorkerPool.map``): the fitted actors are the ones collected in this process,
    weight for weight."""
    config = tiny_data["config"]
    fitted = {}
    for workers in (1, 2):
        ppo = PPOConfig(**{**QUICK_PPO, "imitation_steps": 1500, "imitation_epochs": 5, "workers": workers})
        trainer = tiny_trainer(tiny_data, ppo)
        assert trainer.workers == workers
        trainer.imitate(analytic_for(config))
        fitted[workers] = (
            trainer.imitation,
            [trainer.actor(n).to_spec()["weights"] for n in ("size", "depth")],
        )
        trainer.close()
    assert fitted[1][0] == fitted[2][0]
    for one, two in zip(fitted[1][1], fitted[2][1]):
        assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_the_teacher_follows_each_episodes_cost_profile(tiny_data):
    config, profile = tiny_data["config"], tiny_data["profile"]
    made = []

    def make(p):
        made.append(p)
        return AnalyticController(p, config.tree_width, config.max_depth)

    mix = ProfileMix([profile], reference=profile, perturbation=1.0)
    backend = ReplayBackend(tiny_data["train"], profile, profiles=mix)
    data = collect(backend, "size", make, EnvConfig(depth_zero=True), 200, 0.5, seed=3)
    assert len(data.actions) >= 200 and len(data.obs) == len(data.returns) == len(data.actions)
    assert np.isfinite(data.returns).all()
    # one teacher per episode profile: several episodes drew several perturbed profiles
    assert len({id(p) for p in made}) > 1
    # within one episode the teacher is kept (its online calibration carries over the episode's cycles)
    teacher = FollowingTeacher(make, config.tree_width)

    class Env:
        profile = tiny_data["profile"]

    teacher.env = Env()
    first = teacher._teacher()
    assert teacher._teacher() is first
    Env.profile = mix.sample(np.random.default_rng(0))
    assert teacher._teacher() is not first


def test_verdict_names_the_winner_and_the_summary_lists_every_baseline():
    base = {
        "autoregressive_on_val": 27.1,
        "static_best_on_val": 30.2,
        "best_static_val": [2, 2],
        "analytic_on_val": 31.4,
        "oracle_on_val": 38.4,
        "val_prompts": ["a", "b"],
    }
    lost = {**base, "learned_on_val": 30.2, "learned_over_oracle": 30.2 / 38.4}
    judged = train_data.verdict(lost)
    assert (
        judged["winner"] == "analytic" and "analytic controller beats the learned policy" in judged["verdict"]
    )
    assert judged["learned_over"]["analytic"] == pytest.approx(30.2 / 31.4)
    won = {**base, "learned_on_val": 32.5, "learned_over_oracle": 32.5 / 38.4}
    assert train_data.verdict(won)["winner"] == "learned"
    text = train_data.summary_text({**won, "verdict": train_data.verdict(won)["verdict"]})
    for label in ("autoregressive", "best static", "analytic", "oracle", "verdict: the learned policy"):
        assert label in text
    assert f"{32.5 / 31.4:.3f}x" in text and f"{32.5 / 27.1:.3f}x" in text


def test_rho_starts_at_the_analytic_controllers_throughput_when_it_is_the_best_known():
    base = {"static_train_on_val": 21.0, "autoregressive_on_val": 24.0, "analytic_on_val": 26.0}
    assert train_data.starting_rho(base, TrainConfig()) == 26.0


def test_imitation_settings_are_checked():
    with pytest.raises(ValueError, match="imitation_steps"):
        PPOConfig(imitation_steps=-1)
    with pytest.raises(ValueError, match="imitation_epochs"):
        PPOConfig(imitation_epochs=0)

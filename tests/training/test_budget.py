"""The main job's budget rules (training.ppo.CoTrainer.size_phases_idle): later size phases are skipped once a
size phase left the best validation score where it found it; its default workload."""

from __future__ import annotations

from types import SimpleNamespace

from training.ppo import CoTrainer
from training.ppo_config import PhaseLog


def idle(*phases) -> bool:
    history = [PhaseLog(name, 0, steps, 1.0, [(0, v) for v in scores]) for name, steps, scores in phases]
    return CoTrainer.size_phases_idle(SimpleNamespace(history=history))


def test_a_size_phase_that_does_not_raise_the_best_score_makes_later_ones_idle():
    assert not idle()  # nothing trained yet
    assert not idle(("imitation", 0, [0.876]))
    assert idle(("imitation", 0, [0.876]), ("size", 50_000, [0.8755, 0.876]))
    assert idle(("imitation", 0, [0.876]), ("size", 50_000, [0.8765]))  # within the tolerance (0.1%)
    # negative control: a size phase that raised the score keeps the size phases
    assert not idle(("imitation", 0, [0.876]), ("size", 50_000, [0.87, 0.89]))
    # the verdict is the last trained size phase's; a depth phase after it does not change it, a skipped size
    # phase (no steps) keeps it
    base = [("imitation", 0, [0.876]), ("size", 50_000, [0.876]), ("depth", 200_000, [0.93])]
    assert idle(*base) and idle(*base, ("size", 0, []))
    raised = [("imitation", 0, [0.876]), ("size", 50_000, [0.876]), ("depth", 200_000, [0.93])]
    assert not idle(*raised, ("size", 50_000, [0.95]))


def test_the_main_jobs_default_workload_is_the_mixed_one_except_on_the_tiny_pair():
    from training.train_config import TrainConfig, effective_config

    assert effective_config(TrainConfig()).prompts == "mixed"  # the default pair: named in the stored config
    assert effective_config(TrainConfig(pair="tiny")).prompts is None  # the suite: 1,024-byte contexts
    assert effective_config(TrainConfig(prompts="suite")).prompts == "suite"  # a named set is kept

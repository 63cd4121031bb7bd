"""Everything that trains a controller or exports one (never imported on the inference path: ``serving`` and
``policies`` import none of it; stable-baselines3 and gymnasium enter here, through ``envs``).

    ppo.py            CoTrainer: the imitation start, co-adaptive PPO on the environments, checkpoints, resume
    ppo_config.py     PPOConfig, PhaseLog, the SB3 callback, actor_from_model
    ppo_checkpoint.py the checkpoint's signed manifest, verify_checkpoint, has_checkpoint, read_trainer_state
    imitation.py      the imitation start: the analytic controller's decisions, actors and critics fitted to them
    train_config.py   TrainConfig (train.py's flags), the --quick preset, the run directory
    train_data.py     a run's prompts, profile and traces, the randomised-device mix, baselines, the verdict
    load_training.py  the load-aware main job on the server replay, its baselines and load_report
    export.py         a policy's per-load draft lengths as vLLM's and SGLang's files, the tuned table beside them
"""

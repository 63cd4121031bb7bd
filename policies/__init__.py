"""Controllers that decide draft depth and verification size at inference. All implement
``engine.control.Controller``; the engine never imports this package, and this package imports only the
engine (the training code, ``training``, and stable-baselines3 are never imported on the inference path).

    static.py              BatchSizeTableController (the static setting per load level) and its table file
    heuristic.py           HeuristicController (+2/-1), ConfidenceController (draft p-min)
    analytic.py            AnalyticController (the speedup model's estimates, calibrated online)
    goodput.py             GoodputController (the chain length from the request's acceptance and the load)
    learned.py             load_policy, save_policy: the exported policy file, its hash and checks
    learned_controller.py  LearnedController, its torch-only Actors, PolicyFileError

The fixed depth and size, ``StaticController``, is an engine primitive: ``engine.control``."""

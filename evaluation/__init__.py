"""The evaluation behind ``python evaluate.py``: every controller measured live on the same engine,
models and prompts (interleaved), against autoregressive decoding, the grid-searched static baselines and
transformers' assisted generation; replay upper bound; load; exactness audit; report.

    config.py       EvalConfig (flags are generated from it), --quick preset, prompt selection
    tuning.py       static grid: replay grid on the tune split, top configurations confirmed live
    eval_setup.py   what every part shares: config, prompts, models, profile, policy, controller factories
    runner.py       interleaved live runs, replay section, exactness section, the whole evaluation
    peers.py        transformers' assisted generation (default and heuristic schedules)
    measurements.py one measured request, the decision log of the learned controller, reduction
    stats.py        paired bootstrap intervals of throughput ratios
    summary.py      tables, ratios, replay vs live, targets
    concurrency.py  N concurrent requests (threads, one engine each, shared weights)
    exactness.py    greedy token audit, sampled two-sample test, sampler law checks
    report.py, report_tables.py, plots.py   report.md (writers; sections), results.json, PNG figures
    shift.py, shift_config.py, shift_report.py   python evaluate.py shift (runner; config, slices; report)
"""

"""Does Fair Cast help? Paired A/B runs of one GRPO recipe (TRL + a colocated vLLM engine) that differ only in
how the served copy is made, and the paired statistics to read them.

    faircast ab --preset smoke            # structure check (CI)
    faircast ab --preset cpu              # the pre-registered CPU reproduction (benchmarks/ab/PROTOCOL.md)
    faircast ab --model DIR --dataset F   # your model and jsonl (prompt, answer) on GPUs
    faircast ab-stats --metric M --run ARM:SEED:FILE ...   # the same paired report for runs you already made

Modules: ``task`` (the built-in task, a user's jsonl, the reward), ``warmstart`` (the SFT'd small model, in bf16),
``arms`` (what each arm changes), ``run_one`` (one TRL run of one arm and seed, evaluated through the engine),
``runner`` (the grid of runs, resumable), ``scoring`` (exact expected/greedy success), ``stats`` (paired tests),
``protocol`` (presets and provenance), ``report`` (results.json, report.md, curves.png), ``cli``.
"""

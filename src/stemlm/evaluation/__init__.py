"""Evaluation: held-out perplexity, lm-evaluation-harness tasks, and needle-in-a-haystack retrieval.

Modules: `perplexity` (sliding-window loss / perplexity / bits per byte), `lm_eval_adapter` (the `StemlmLM`
adapter for EleutherAI's lm-evaluation-harness and `run_lm_eval`), `tasks` (the shipped lm-eval tasks: how
their data is built, how task files are found and checked), `niah` (RULER-style needle-in-a-haystack grids,
heatmaps and passkey training documents). Names load lazily, so `import stemlm.evaluation` stays cheap and
lm-eval is imported only when the adapter is used:

    from stemlm.evaluation import evaluate_perplexity, run_niah
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "evaluate_perplexity": "stemlm.evaluation.perplexity",
    "token_logprobs": "stemlm.evaluation.perplexity",
    "rolling_windows": "stemlm.evaluation.perplexity",
    "PerplexityResult": "stemlm.evaluation.perplexity",
    "StemlmLM": "stemlm.evaluation.lm_eval_adapter",
    "run_lm_eval": "stemlm.evaluation.lm_eval_adapter",
    "summarize_results": "stemlm.evaluation.lm_eval_adapter",
    "SHIPPED_TASKS": "stemlm.evaluation.tasks",
    "load_task_configs": "stemlm.evaluation.tasks",
    "build_task_files": "stemlm.evaluation.tasks",
    "make_niah_sample": "stemlm.evaluation.niah",
    "run_niah": "stemlm.evaluation.niah",
    "model_answerer": "stemlm.evaluation.niah",
    "passkey_documents": "stemlm.evaluation.niah",
    "plot_niah_heatmap": "stemlm.evaluation.niah",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)

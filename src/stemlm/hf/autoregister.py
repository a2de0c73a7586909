"""Registering `StemlmConfig` / `StemlmForCausalLM` with transformers' Auto classes without slowing `import stemlm`.

Registering needs the two classes, and the model class needs transformers' model code (`modeling_utils`,
`generation`: seconds of imports), which neither `import stemlm` nor a user who only imports, say,
`AutoTokenizer` (it loads the auto modules too) should pay. So registration follows need:

- `AutoConfig` learns "stemlm" right after `transformers.models.auto.configuration_auto` executes (cheap: the
  config class needs only `configuration_utils`, already loaded by then).
- `AutoModel`, `AutoModelForCausalLM` and the task heads' Auto classes (`stemlm.hf.heads`) learn it when both their
  module (`...auto.modeling_auto`) is loaded and a `StemlmConfig` has been created, whichever comes last. Every Auto
  path reaches the model class through a config instance (`from_pretrained` reads config.json first, `from_config` takes
  one), so that is never late, and the model-code imports happen just when `from_pretrained` would make them anyway.

`install()` (run by `import stemlm`) handles auto modules already imported and puts a small finder at the front
of `sys.meta_path` for the others (one dict lookup per import until both have loaded; then it removes itself).
A failed registration never breaks the user's import: it warns and leaves `register()` to call by hand.
"""

import sys
from importlib import import_module

CONFIG_AUTO = "transformers.models.auto.configuration_auto"
MODEL_AUTO = "transformers.models.auto.modeling_auto"
_state = {"config_created": False, "model_registered": False}


def register_config(configuration_auto) -> None:
    from stemlm.hf.configuration import StemlmConfig
    from stemlm.model.config import MODEL_TYPE

    configuration_auto.AutoConfig.register(MODEL_TYPE, StemlmConfig, exist_ok=True)


def register_model(modeling_auto) -> None:
    from stemlm.hf.configuration import StemlmConfig
    from stemlm.hf.heads import (
        StemlmForQuestionAnswering,
        StemlmForSequenceClassification,
        StemlmForTokenClassification,
    )
    from stemlm.hf.modeling import StemlmForCausalLM, StemlmModel

    modeling_auto.AutoModel.register(StemlmConfig, StemlmModel, exist_ok=True)
    modeling_auto.AutoModelForCausalLM.register(StemlmConfig, StemlmForCausalLM, exist_ok=True)
    modeling_auto.AutoModelForSequenceClassification.register(
        StemlmConfig, StemlmForSequenceClassification, exist_ok=True
    )
    modeling_auto.AutoModelForTokenClassification.register(StemlmConfig, StemlmForTokenClassification, exist_ok=True)
    modeling_auto.AutoModelForQuestionAnswering.register(StemlmConfig, StemlmForQuestionAnswering, exist_ok=True)
    _state["model_registered"] = True


def register() -> None:
    """Register the stemlm classes with `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and the task-head Auto
    classes (sequence and token classification, question answering) now (imports transformers)."""
    register_config(import_module(CONFIG_AUTO))
    register_model(import_module(MODEL_AUTO))


def _model_auto_loaded(modeling_auto) -> None:
    if _state["config_created"]:
        register_model(modeling_auto)


def config_created() -> None:
    """Called by every new `StemlmConfig`: the first one registers the model class if `modeling_auto` is loaded."""
    _state["config_created"] = True
    if not _state["model_registered"] and MODEL_AUTO in sys.modules:
        _run(register_model, sys.modules[MODEL_AUTO])


def _configuration_loaded(configuration) -> None:
    configuration.CREATED_HOOKS.append(config_created)  # stemlm.hf.configuration calls back; it imports nothing here


ACTIONS = {
    CONFIG_AUTO: register_config,
    MODEL_AUTO: _model_auto_loaded,
    "stemlm.hf.configuration": _configuration_loaded,
}


def _run(action, module) -> None:
    try:
        action(module)
    except Exception as exc:  # a failure here must not break the user's `import transformers`
        import warnings

        warnings.warn(
            f"stemlm could not register its model with transformers' Auto classes ({type(exc).__name__}: {exc}); "
            "call stemlm.hf.register() after importing transformers",
            stacklevel=2,
        )


class _RunAfterExec:
    """Loader proxy: executes the module with the real loader, then runs the registration action."""

    def __init__(self, loader, action) -> None:
        self._loader, self._action = loader, action

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run(self._action, module)

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _AutoModuleFinder:
    """A meta-path finder that answers only for the awaited auto modules, wrapping their real loader."""

    def __init__(self, pending: dict) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path=None, target=None):
        action = self.pending.get(fullname)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        del self.pending[fullname]
        if not self.pending:
            sys.meta_path.remove(self)
        spec.loader = _RunAfterExec(spec.loader, action)
        return spec


def install() -> None:
    """Register with the auto modules already imported; arrange registration with the others when they are."""
    pending = {}
    for name, action in ACTIONS.items():
        module = sys.modules.get(name)
        if module is not None:
            _run(action, module)
        else:
            pending[name] = action
    if pending and not any(isinstance(f, _AutoModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AutoModuleFinder(pending))

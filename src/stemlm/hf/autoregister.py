"""Registering the stemlm classes with transformers' Auto classes, whatever the order of imports, without slowing
`import stemlm`.

Registering needs the classes, and the model classes need transformers' model code (`modeling_utils`, `generation`:
seconds of imports), which neither `import stemlm` nor a user who only imports, say, `AutoTokenizer` should pay. So
registration follows need:

- `AutoConfig` learns "stemlm" once `transformers.models.auto.configuration_auto` is loaded (cheap: the config
  class needs only `configuration_utils`).
- `AutoModel`, `AutoModelForCausalLM` and the task heads' Auto classes (`stemlm.hf.heads`) learn it once both their
  module (`...auto.modeling_auto`) is loaded and a `StemlmConfig` has been created. Every Auto path reaches the model
  class through a config instance (`from_pretrained` reads config.json first, `from_config` takes one), so that is
  never late, and the model-code imports happen just when `from_pretrained` would make them anyway.

The one hazard is registering in the middle of an import: `transformers.modeling_layers` imports `modeling_auto`
halfway through its own body (and `stemlm.hf.modeling` imports `modeling_layers`), so right after `modeling_auto`
loads, the model classes may not be importable yet. `sync()` therefore registers only when none of the `WATCHED`
modules is half-imported, and runs again each time one of them finishes loading and each time a `StemlmConfig` is
created: a registration that has to wait is retried at the next of those, and the model classes are all imported
before any is registered, so it is never left half-done. The last watched import to finish is the outermost one
and always finds the others complete.

`install()` (run by `import stemlm`) syncs with the modules already imported and puts a small finder at the front
of `sys.meta_path` for the others (one dict lookup per import until they have loaded; then it removes itself).
A failure that is not a half-import never breaks the user's import: it warns once and is retried like the others;
`register()` does it all explicitly.
"""

import sys
from importlib import import_module

CONFIG_AUTO = "transformers.models.auto.configuration_auto"
MODEL_AUTO = "transformers.models.auto.modeling_auto"
CONFIGURATION = "stemlm.hf.configuration"
# The modules a registration imports or waits for; each one's end of loading runs `sync()` again.
WATCHED = (
    CONFIG_AUTO,
    MODEL_AUTO,
    "transformers.modeling_layers",
    CONFIGURATION,
    "stemlm.hf.modeling",
    "stemlm.hf.heads",
)
# "syncing" is set while sync() runs: the imports it makes end in watched modules, which do not start another.
_state = {"config_registered": False, "model_registered": False, "config_created": False, "warned": False,
          "syncing": False}  # fmt: skip


def register_config(configuration_auto) -> None:
    from stemlm.hf.configuration import StemlmConfig
    from stemlm.model.config import MODEL_TYPE

    configuration_auto.AutoConfig.register(MODEL_TYPE, StemlmConfig, exist_ok=True)
    _state["config_registered"] = True


def register_model(modeling_auto) -> None:
    # Every class first, so an import that fails leaves no Auto class registered.
    from stemlm.hf.configuration import StemlmConfig
    from stemlm.hf.heads import (
        StemlmForQuestionAnswering,
        StemlmForSequenceClassification,
        StemlmForTokenClassification,
    )
    from stemlm.hf.modeling import StemlmForCausalLM, StemlmModel

    for auto, model_class in (
        (modeling_auto.AutoModel, StemlmModel),
        (modeling_auto.AutoModelForCausalLM, StemlmForCausalLM),
        (modeling_auto.AutoModelForSequenceClassification, StemlmForSequenceClassification),
        (modeling_auto.AutoModelForTokenClassification, StemlmForTokenClassification),
        (modeling_auto.AutoModelForQuestionAnswering, StemlmForQuestionAnswering),
    ):
        auto.register(StemlmConfig, model_class, exist_ok=True)
    _state["model_registered"] = True


def register() -> None:
    """Register the stemlm classes with `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and the task-head Auto
    classes (sequence and token classification, question answering) now (imports transformers)."""
    register_config(import_module(CONFIG_AUTO))
    register_model(import_module(MODEL_AUTO))


def _half_imported(name: str) -> bool:
    # importlib marks a module whose body is still running this way (its "partially initialized module" error
    # reads the same flag).
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


def sync(finished: str | None = None) -> None:
    """Register what can be registered now; `finished` names a watched module whose body has just run (importlib
    still marks it as loading). Does nothing while a watched module is half-imported: its end calls this again."""
    if _state["syncing"] or any(_half_imported(name) for name in WATCHED if name != finished):
        return
    _state["syncing"] = True
    try:
        if not _state["config_registered"] and CONFIG_AUTO in sys.modules:
            register_config(sys.modules[CONFIG_AUTO])
        if not _state["model_registered"] and _state["config_created"] and MODEL_AUTO in sys.modules:
            register_model(sys.modules[MODEL_AUTO])
    except Exception as exc:  # a failure here must not break the user's import; it is retried at the next sync
        if not _state["warned"]:
            import warnings

            _state["warned"] = True
            warnings.warn(
                f"stemlm could not register its model with transformers' Auto classes ({type(exc).__name__}: {exc}); "
                "it tries again when the next StemlmConfig is created, or call stemlm.hf.register()",
                stacklevel=2,
            )
    finally:
        _state["syncing"] = False


def config_created() -> None:
    """Called by every new `StemlmConfig` (`stemlm.hf.configuration.CREATED_HOOKS`)."""
    _state["config_created"] = True
    if not _state["model_registered"]:
        sync()


def _loaded(name: str, module) -> None:
    if name == CONFIGURATION and config_created not in module.CREATED_HOOKS:
        module.CREATED_HOOKS.append(config_created)  # it calls back; it imports nothing of this module
    sync(finished=name)


class _SyncAfterExec:
    """Loader proxy: executes the module with the real loader, then syncs the registration."""

    def __init__(self, loader, finder: "_WatchedModuleFinder") -> None:
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._finder.done(module.__name__)
        _loaded(module.__name__, module)

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _WatchedModuleFinder:
    """A meta-path finder that answers only for the watched modules not loaded yet, wrapping their real loader."""

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in self.pending:
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
        spec.loader = _SyncAfterExec(spec.loader, self)
        return spec

    def done(self, name: str) -> None:
        """`name` has loaded (a failed import stays pending, so its next try is watched too)."""
        self.pending.discard(name)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Sync with the watched modules already imported; arrange a sync after each of the others loads."""
    pending = {name for name in WATCHED if name not in sys.modules}
    if CONFIGURATION in sys.modules:
        _loaded(CONFIGURATION, sys.modules[CONFIGURATION])
    if pending and not any(isinstance(f, _WatchedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _WatchedModuleFinder(pending))
    sync()

"""Whether transformers can run an architecture for pagedllm, and which of its classes: the fallback's checks.

A model runs through the fallback when transformers has a class for it (a causal LM, or an encoder's base model
for pooling; in the library, or in the model folder's own code under ``--trust-remote-code``) whose attention
layers call the attention interface (``_supports_attention_backend``): only then can pagedllm's paged attention
take their place. Anything else gets a ValueError naming the architecture and the reason.
"""

from __future__ import annotations

from typing import Any


def _refuse(architecture: str, why: str) -> ValueError:
    return ValueError(f"model: architecture {architecture} cannot run through the transformers fallback: {why}")


def is_fallback_encoder(hf_config: Any, architecture: str) -> bool:
    """Whether the fallback runs this model as an encoder (pooling only): its model type is a masked-LM encoder's
    (BERT, RoBERTa, ...) and the architecture is not one of its causal heads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return (getattr(hf_config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not architecture.endswith(("ForCausalLM", "LMHeadModel")))


def remote_code_class_ref(hf_config: Any, encoder: bool = False) -> str | None:
    """The folder's own model class reference (``config.json``'s ``auto_map``), or None."""
    auto_map = getattr(hf_config, "auto_map", None) or {}
    return auto_map.get("AutoModel" if encoder else "AutoModelForCausalLM")


def transformers_model_class(hf_config: Any, architecture: str, trust_remote_code: bool = False) -> type:
    """The transformers class that runs ``architecture`` (a name in ``config.architectures``): its causal LM, or
    for an encoder (``is_fallback_encoder``) its base model; ValueError with the reason when there is none that
    pagedllm's attention can drive."""
    import transformers

    encoder = is_fallback_encoder(hf_config, architecture)
    ref = remote_code_class_ref(hf_config, encoder)
    cls = None
    if ref is not None and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        folder = getattr(hf_config, "_name_or_path", "")
        cls = get_class_from_dynamic_module(ref, folder, local_files_only=True)
    if cls is None and encoder:
        from transformers import MODEL_MAPPING

        cls = MODEL_MAPPING.get(type(hf_config), None)
    if cls is None:  # the library's class (preferred, as transformers does, when remote code is not trusted)
        cls = getattr(transformers, architecture, None)
        if not isinstance(cls, type):
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

            cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if cls is None:
        if ref is not None:
            raise _refuse(architecture, f"its folder ships its own modeling code ({ref}); pass --trust-remote-code "
                                        "(trust_remote_code=True) to run it")
        raise _refuse(architecture, f"transformers {transformers.__version__} has no model class for it "
                                    f"(model_type {getattr(hf_config, 'model_type', '?')!r})")
    compatible = getattr(cls, "is_backend_compatible", None)
    if not (compatible() if callable(compatible) else getattr(cls, "_supports_attention_backend", False)):
        raise _refuse(architecture, f"its transformers class {cls.__name__} does not support the attention "
                                    "interface (_supports_attention_backend), so its attention cannot be "
                                    "replaced by pagedllm's paged attention")
    if getattr(hf_config, "is_encoder_decoder", False):
        raise _refuse(architecture, "encoder-decoder models are not supported by the fallback")
    return cls


def unreadable_config_error(architectures: list[str], model_type: str | None, has_remote_code: bool,
                            trust_remote_code: bool, cause: Exception) -> ValueError:
    """The error for a config.json transformers cannot read (an unknown ``model_type``)."""
    import transformers

    arch = ", ".join(architectures) or "(none listed)"
    if has_remote_code and not trust_remote_code:
        why = "its folder ships its own modeling code (config.json's auto_map); pass --trust-remote-code to run it"
    else:
        why = (f"model_type {model_type!r} is unknown to transformers {transformers.__version__} ({cause}); "
               "a newer transformers may know it")
    return _refuse(arch, why)


def check_fallback_settings(architecture: str, quantization: str | None, hf_config: Any) -> None:
    """Refuse what the fallback cannot give: its linear layers are transformers' own ``nn.Linear``, not pagedllm's
    packed or quantized ones."""
    # Masks transformers builds from the config and pagedllm's backends would not apply (they mask from the step's
    # metadata: causal, sliding window, encoder).
    if getattr(hf_config, "attention_chunk_size", None):
        raise _refuse(architecture, f"chunked attention (attention_chunk_size={hf_config.attention_chunk_size}) "
                                    "is not among pagedllm's attention masks")
    stored = getattr(hf_config, "quantization_config", None)
    if quantization not in (None, "none") or stored:
        what = f"--quantization {quantization}" if quantization not in (None, "none") else "a quantized checkpoint"
        raise ValueError(f"quantization: {what} is not supported through the transformers fallback "
                         f"({architecture} has no native implementation; the fallback runs float weights only)")


def transformers_causal_lm_architectures(skip: set[str]) -> list[tuple[str, str, bool]]:
    """(architecture, model_type, whether its class supports the attention interface) for every causal LM of the
    installed transformers not in ``skip``. Imports every class (about 20 s): for ``pagedllm models --fallback``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = []
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if not isinstance(name, str) or name in skip:
            continue
        try:
            cls = getattr(transformers, name)
        except (ImportError, AttributeError):  # a class whose optional dependency is missing
            continue
        rows.append((name, model_type, bool(cls.is_backend_compatible())))
    return rows


def make_remote_config_picklable(hf_config: Any) -> None:
    """A config whose class comes from a folder's own code (``transformers_modules.*``) pickles as (class
    reference, folder, values), so an engine process (spawned: it unpickles before it can import that code) rebuilds
    it by importing the folder's code first. Nothing for a library config."""
    import copyreg

    cls = type(hf_config)
    ref = (getattr(hf_config, "auto_map", None) or {}).get("AutoConfig")
    if not cls.__module__.startswith("transformers_modules") or not ref:
        return
    copyreg.pickle(cls, lambda config: (rebuild_remote_config, (ref, config._name_or_path, config.to_dict())))


def rebuild_remote_config(ref: str, folder: str, values: dict) -> Any:
    """The inverse of ``make_remote_config_picklable``'s reduction (in the process that unpickles)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cls = get_class_from_dynamic_module(ref, folder, local_files_only=True)
    config = cls.from_dict(values)
    config._name_or_path = folder
    make_remote_config_picklable(config)  # handed on again from there (a data-parallel engine's ranks)
    return config

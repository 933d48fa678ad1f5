"""What ``transformers.Trainer``, TRL and PEFT call on a model, implemented on ours without inheriting
``PreTrainedModel`` (which would make every model carry HF's config class, loading machinery and generation
mixin): the activation-checkpointing switches, the embeddings accessors, ``can_generate``, ``from_pretrained``,
and a ``load_state_dict`` that also reads HF's canonical layout (what ``save_pretrained`` and transformers write,
and what ``flash_models.hf.SavePretrainedCallback`` leaves in the Trainer's checkpoints).

Every model class mixes this in; the decoder and the task heads set the class attributes that differ."""

from __future__ import annotations

import functools
import inspect
from copy import deepcopy

import torch
import torch.utils.checkpoint
from torch import nn

from ..backward import backward_on_this_thread_from_now
from ..modules import Embeddings
from ..modules.kv_cache import KVCache
from .outputs import NO_CACHE


class HFModelProtocol:
    main_input_name = "input_ids"  # the Trainer counts input tokens of this input
    supports_gradient_checkpointing = True
    # Whether the forward takes ``num_items_in_batch`` and normalizes its loss by it (the Trainer then leaves
    # gradient accumulation's averaging to the loss). Token-level LM losses do; per-example losses do not.
    accepts_loss_kwargs = False

    @classmethod
    def can_generate(cls) -> bool:
        return False

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """``flash_models.from_pretrained(path, **kwargs)``, checked to give this class."""
        from ..checkpoint import from_pretrained  # a higher layer: imported on use

        model = from_pretrained(path, **kwargs)
        if not isinstance(model, cls):
            raise ValueError(f"{path} holds a {type(model).__name__}, not a {cls.__name__}; "
                             "use flash_models.from_pretrained to get whichever class the checkpoint names")
        return model

    @property
    def _no_split_modules(self) -> list[str]:
        """The class names of the transformer blocks, HF's attribute for the unit that is sharded or placed whole:
        accelerate's transformer-based FSDP wrapping (``transformers.Trainer`` with ``fsdp_config``) gives each
        block its own FSDP unit by these names, and without them would shard the model as one unit."""
        return sorted({type(block).__name__ for block in self._transformer_blocks()})

    # ----------------------------------------------------------------------------------------------------
    def _transformer_blocks(self) -> nn.ModuleList:
        blocks = [m for name, m in self.named_modules() if name.rsplit(".", 1)[-1] == "blocks" and isinstance(m, nn.ModuleList)]
        assert len(blocks) == 1, f"{type(self).__name__} keeps its transformer blocks in one ModuleList named blocks"
        return blocks[0]

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, *,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute every ``every_n_layers``-th block in the backward instead of keeping its activations, while
        the model trains (``CheckpointedForward``); ``activation_checkpointing_kwargs`` go to
        torch.utils.checkpoint (``use_reentrant`` defaults to False). Called by ``transformers.Trainer`` for
        ``TrainingArguments(gradient_checkpointing=True)``."""
        if offload:
            raise ValueError("activation checkpointing with offload=True (saved activations on the CPU) is not "
                             "supported by flash-models models; leave offload off")
        if every_n_layers < 1:
            raise ValueError(f"checkpoint every n-th block needs every_n_layers >= 1, got {every_n_layers}")
        self.activation_checkpointing_disable()  # a second call with other settings replaces the first
        options = {"use_reentrant": False, **dict(activation_checkpointing_kwargs or {})}
        for block in list(self._transformer_blocks())[::every_n_layers]:
            CheckpointedForward.attach(block, options)
        if self.get_input_embeddings() is not None:
            # As HF's models do: with frozen embeddings (PEFT adapters), reentrant checkpointing would find no
            # input that requires grad and give the adapters inside the blocks no gradient at all.
            self.enable_input_require_grads()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, *,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """HF's older name for ``activation_checkpointing_enable``."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload)

    def activation_checkpointing_disable(self) -> None:
        for block in self._transformer_blocks():
            CheckpointedForward.detach(block)
        self.disable_input_require_grads()

    gradient_checkpointing_disable = activation_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(isinstance(block.__dict__.get("forward"), CheckpointedForward) for block in self._transformer_blocks())

    is_activation_checkpointing = is_gradient_checkpointing

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """HF's parameter count: each parameter once, at the real vocabulary (the pad rows of the token table and
        LM head, modules/vocab_padding.py, are not counted); ``exclude_embeddings`` leaves out the ``nn.Embedding``
        tables (tokens, positions, token types), ``only_trainable`` the frozen parameters. The Trainer's
        ``total_flos`` is 6 * input tokens * ``num_parameters(exclude_embeddings=True)``, and 0 without this."""
        # The Trainer asks at every step (floating_point_ops), and the state dict behind the count costs a
        # millisecond of host time: the count is kept until a parameter is replaced, resized or (un)frozen.
        key = (only_trainable, exclude_embeddings, tuple((id(p), p.shape, p.requires_grad) for p in self.parameters()))
        cached = self.__dict__.get("_num_parameters")
        if cached is not None and cached[0] == key:
            return cached[1]
        embeddings = ({f"{name}.weight" for name, m in self.named_modules() if isinstance(m, nn.Embedding)}
                      if exclude_embeddings else set())
        real = self.state_dict(keep_vars=True)  # views without the pad rows
        count = sum(real.get(name, param).numel() for name, param in self.named_parameters()
                    if name not in embeddings and (param.requires_grad or not only_trainable))
        self.__dict__["_num_parameters"] = (key, count)
        return count

    def add_model_tags(self, tags: str | list[str]) -> None:
        """Tags for the model card (TRL adds "trl", "sft"): kept in ``model_tags``, in order, once each."""
        current = self.__dict__.setdefault("model_tags", [])
        current.extend(tag for tag in ([tags] if isinstance(tags, str) else tags) if tag not in current)

    @property
    def vocab_size(self) -> int:
        """HF's ``model.vocab_size``, which its causal LMs and every model after ``resize_token_embeddings`` carry
        (TRL's ``clone_chat_template`` reads it after resizing): the config's, the real vocabulary."""
        return self.config.vocab_size

    # ----------------------------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module | None:
        """The token embedding table (PEFT and TRL hook it, e.g. ``enable_input_require_grads``), None without one.
        ViT, which reads no tokens, overrides it with the module of its patch tokens, as HF's ViT does."""
        tables = [m.tokens for m in self.modules() if isinstance(m, Embeddings)]
        assert len(tables) <= 1, f"{type(self).__name__} has one token table at most"
        return tables[0] if tables else None

    def enable_input_require_grads(self) -> None:
        """Make the embeddings' output require grad, so that checkpointed blocks of a model whose embeddings are
        frozen (PEFT adapters) still get a backward (HF's method of the same name; PEFT calls it when it wraps a
        checkpointed model); ViT's patch tokens take the same hook, as HF's do (our checkpointed blocks also make
        their own input require grad where reentrant checkpointing needs it)."""
        table = self.get_input_embeddings()
        if table is None:
            return
        self.disable_input_require_grads()  # one hook, however often this is called
        self._require_grads_hook = table.register_forward_hook(_output_requires_grad)

    def disable_input_require_grads(self) -> None:
        hook = self.__dict__.pop("_require_grads_hook", None)
        if hook is not None:
            hook.remove()

    # ----------------------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, which also reads HF's canonical layout: a state dict with keys this
        model does not have is converted by the family's checkpoint rules first (every key must match one;
        unmatched keys raise, listing them). ``transformers.Trainer`` resumes a checkpoint this way."""
        own = set(self.state_dict())
        if not set(state_dict) <= own:
            from ..checkpoint.remap import hf_to_ours  # higher layers: imported on use
            from ..registry import rules_for

            state_dict = hf_to_ours(dict(state_dict), rules_for(self.config))
        return nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)


def _output_requires_grad(module, args, output) -> None:
    """``enable_input_require_grads``' hook (a module-level function: a hooked model still pickles)."""
    output.requires_grad_(True)


class CheckpointedForward:
    """A block's forward run through ``torch.utils.checkpoint`` while the block trains with autograd recording
    (HF's rule for its checkpointed layers), set on the block itself as its ``forward``. Not a wrapper module
    (``modules.recompute.checkpoint_blocks``, which flash-models' own trainer uses): module names stay the plain
    model's, and PEFT, which matches the names of ``named_modules()`` against the keys of ``state_dict()``, would
    otherwise save and load no adapter weights at all for a checkpointed model. Keyword arguments travel as
    positional ones, which reentrant checkpointing requires."""

    def __init__(self, block: nn.Module, options: dict, recompute_norm_outputs: bool | None):
        self.block, self.options, self.recompute_norm_outputs = block, options, recompute_norm_outputs

    @classmethod
    def attach(cls, block: nn.Module, options: dict) -> None:
        # The whole block is recomputed: its own recompute of saved norm outputs would only add work.
        recompute_norms = getattr(block, "recompute_norm_outputs", None)  # pre-norm blocks only
        if recompute_norms:
            block.recompute_norm_outputs = False
        block.forward = cls(block, options, recompute_norms)

    @staticmethod
    def detach(block: nn.Module) -> None:
        attached = block.__dict__.get("forward")
        if isinstance(attached, CheckpointedForward):
            del block.forward
            if attached.recompute_norm_outputs is not None:
                block.recompute_norm_outputs = attached.recompute_norm_outputs

    def __call__(self, *args, **kwargs):
        block = self.block
        if not (block.training and torch.is_grad_enabled()):
            return type(block).forward(block, *args, **kwargs)
        names = list(kwargs)
        if (self.options.get("use_reentrant")
                and not any(torch.is_tensor(a) and a.requires_grad for a in (*args, *kwargs.values()))
                and any(p.requires_grad for p in block.parameters())):
            # Reentrant checkpointing backpropagates into a block only through inputs that require grad: frozen
            # embeddings (PEFT) or frozen patches (ViT, no token table to hook) would leave the block's trainable
            # parameters without a gradient. The input has no history, so a leaf alias of it loses nothing.
            assert args and args[0].is_floating_point(), "a block takes the hidden states as its first argument"
            args = (args[0].detach().requires_grad_(), *args[1:])

        def run(*flat):
            return type(block).forward(block, *flat[:len(args)], **dict(zip(names, flat[len(args):])))

        return torch.utils.checkpoint.checkpoint(run, *args, *kwargs.values(), **self.options)


class TiedOutputEmbeddings(nn.Module):
    """The LM head of a model whose output projection is its token embedding table: ``weight`` is the table and
    there is no bias. A tied model's ``lm_head``, as HF's models have one (tools that hook the output layer, such as
    TRL's activation offloading, look for it by that name), and what its ``get_output_embeddings()`` returns.

    It reads the table from ``embeddings.tokens`` (the model's ``Embeddings``) at each use, so it follows a resized
    or adapter-wrapped table. It holds the embeddings outside the module registry: the table's parameter belongs
    to them alone (one state-dict key, one entry in ``parameters()``)."""

    def __init__(self, embeddings: nn.Module):
        super().__init__()
        self._embeddings = (embeddings,)  # a tuple: not registered as a submodule
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        return self._embeddings[0].tokens.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.weight)

    def extra_repr(self) -> str:
        return "tied to embed.tokens"

    def __deepcopy__(self, memo):
        """Copied with its model (``copy.deepcopy(model)``), tied to the copy's table. Copied alone, it would read
        a hidden copy of the table that nothing trains or saves, which is what PEFT's ``modules_to_save=["lm_head"]``
        does to train a head of its own: that is refused, naming why."""
        embeddings = self._embeddings[0]
        if id(embeddings) not in memo:
            raise TypeError("the LM head of this model is its token embedding table (tie_word_embeddings): it cannot "
                            "be copied on its own, as PEFT's modules_to_save=['lm_head'] copies it to train a separate "
                            "head. Train the table itself (modules_to_save=['embed.tokens']; the head follows it), or "
                            "use a checkpoint with an untied head")
        copy = type(self).__new__(type(self))
        memo[id(self)] = copy
        copy.__dict__.update({name: deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copy


def packed_documents(input_ids, attention_mask, position_ids, kv_cache, cu_seqlens, hf_kwargs: dict):
    """The document offsets (``cu_seqlens``) of a causal LM call, from what HF's trainers and collators pass.

    - ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (and ``max_length_q/k``, ``seq_idx``): FlashAttention's varlen
      arguments, which padding-free collators (TRL's ``padding_free=True``, ``DataCollatorWithFlattening``) add to
      one packed row: the documents' offsets.
    - Otherwise one row (1, S) without an attention mask or cache whose ``position_ids`` restart: each restart
      begins a document (HF's rule for packed rows: a position that does not follow its predecessor), as HF's
      own models read them. This reads the positions on the host.
    - ``use_cache`` is read by the forward (True outside training: a cache that grows, as HF's); not here.
    Unknown names raise (HF's call flags are dropped before, by ``public_forward`` on the forward)."""
    kwargs = dict(hf_kwargs)
    kwargs.pop("use_cache", None)
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    for name in ("max_length_q", "max_length_k", "seq_idx"):  # derived from the offsets where needed
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"forward() got unexpected keyword arguments {sorted(kwargs)}")
    if cu_q is not None:
        if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
            raise ValueError("cu_seq_lens_q != cu_seq_lens_k: a packed causal LM batch has the same documents for "
                             "queries and keys")
        if cu_seqlens is not None:
            raise ValueError("pass the document offsets once: cu_seqlens or cu_seq_lens_q, not both")
        return cu_q.to(device=input_ids.device, dtype=torch.int32)
    if (cu_seqlens is None and position_ids is not None and attention_mask is None and kv_cache is None
            and input_ids.shape[0] == 1):
        return offsets_from_positions(position_ids)
    return cu_seqlens


def cache_argument(hf_kwargs: dict, kv_cache):
    """The KV cache of a causal LM call given our ``kv_cache`` and/or HF's name for it, popped from ``hf_kwargs``:
    ``cache`` (transformers 5.24 on) or ``past_key_values`` (ours: the KVCache a previous call returned as
    ``out.cache`` / ``out.past_key_values``). HF's own cache objects and tuples are refused."""
    given = {name: hf_kwargs.pop(name) for name in ("cache", "past_key_values") if hf_kwargs.get(name) is not None}
    for name, cache in given.items():
        if not isinstance(cache, KVCache):
            raise ValueError(f"{name} must be a flash-models KVCache, got {type(cache).__name__}: {NO_CACHE}")
    caches = {id(c): c for c in (*given.values(), kv_cache) if c is not None}
    if len(caches) > 1:
        raise ValueError(f"pass the cache once: {', '.join(given)}{' and kv_cache' if kv_cache is not None else ''} "
                         "name different caches")
    return next(iter(caches.values()), None)


def public_forward(forward):
    """A model's public ``forward``. Where it records gradients on a CUDA device (one process), later backward calls
    on the calling thread run on that thread (``backward.backward_on_this_thread_from_now``: every loop and trainer
    gets the faster backward). It also takes HF's call flags with their default values, which change nothing here:
    PEFT's task wrappers (``task_type`` CAUSAL_LM, SEQ_CLS, TOKEN_CLS, FEATURE_EXTRACTION) call every model with
    ``inputs_embeds=None, output_attentions=None, output_hidden_states=None, return_dict=None``. Those are dropped
    before the forward runs; a value that asks for what our models do not take or return raises, naming it.
    ``use_cache`` goes on to a forward that takes HF's keyword arguments (``**hf_kwargs``: the decoders', which keep
    a cache with it); the others (encoders, ViT) keep no cache, and drop it whatever its value (TRL's trainers pass
    ``use_cache=False`` to every model, classifiers included). The signature, as ``inspect`` and the Trainer's
    column filter see it, stays the forward's."""
    takes_hf_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())

    @functools.wraps(forward)
    def call(self, *args, **kwargs):
        if not takes_hf_kwargs:
            kwargs.pop("use_cache", None)
        if kwargs.pop("inputs_embeds", None) is not None:
            raise ValueError("inputs_embeds is not supported by flash-models models: pass input_ids (PEFT's "
                             "prompt-learning methods, which feed embeddings, are not supported; LoRA-style adapters are)")
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, None):
                raise ValueError(f"{flag}=True is not supported by flash-models models: they return the last hidden "
                                 "state only (out.last_hidden_state)")
        if kwargs.pop("return_dict", None) is False:
            raise ValueError("return_dict=False is not supported: the output already indexes like a tuple "
                             "(out[0], out.to_tuple())")
        backward_on_this_thread_from_now(self)
        return forward(self, *args, **kwargs)

    return call


def offsets_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """A packed row's document offsets (int32, documents + 1) from its positions (1, S) or (S,): a document
    starts wherever a position does not follow its predecessor (HF's rule). None when the row is one document."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    if not starts.numel():
        return None
    ends = torch.tensor([0, positions.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)

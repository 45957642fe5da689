"""The two built-in language models, `e31-tiny-chat` and `e31-tiny-embed`, built in code.

`build(dir, "chat")` writes a Hugging Face-format directory that `AutoTokenizer` and
`AutoModelForCausalLM` load offline; `build(dir, "embed")` one that `AutoModel` loads, for
mean-pooled embeddings. Nothing is downloaded: the tokenizer is made with the `tokenizers`
library (one token per printable ASCII character, tab and newline, `<unk>` for any other
character, and a few special tokens), the weights are random, drawn from a fixed seed with
torch's own generator (not transformers' initialisers, which change between versions), so that every
build writes the same files. The files are written by hand rather than by `save_pretrained`,
so that a directory built with one transformers version loads with another (the control
plane may build it, a worker with vLLM and an older transformers may load it).

A marker file `e31_model.json` = `{"kind": "chat"|"embed", "context_tokens": N}` tells the
`llm` workload what the model is for and how long its context is.

    python -m e31_worker.workloads.tinymodels DIR --kind chat
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from e31.core.batches import MODEL_MARKER

KINDS = ("chat", "embed")
CONTEXT_TOKENS = 1024     # max_position_embeddings: room for a paragraph, one token a character
HIDDEN = 128              # a few MB of float32 weights at 2 layers
LAYERS = 2
HEADS = 4
SEED = 0
INIT_STD = 0.02           # the usual initialiser scale of a transformer's linear layers
LM_HEAD_STD = 0.15        # logits of std ~1.7: temperature 1 varies among a few characters
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|end|>")
EOS = "<|end|>"           # a chat turn ends here, and so does a generated completion
CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens, then the characters."""
    return {tok: i for i, tok in enumerate(SPECIALS + CHARS)}


def build(directory: Path, kind: str, *, layers: int = LAYERS, hidden: int = HIDDEN) -> Path:
    """Write the `kind` model (chat or embed) into `directory`; returns it. Deterministic."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if hidden % HEADS or layers < 1:
        raise ValueError(f"hidden must be a multiple of {HEADS} and layers at least 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    _write_tokenizer(directory, vocab)
    config = _config(kind, vocab, layers, hidden)
    _write_json(directory / "config.json", config)
    if kind == "chat":
        _write_json(directory / "generation_config.json", {
            "bos_token_id": vocab["<s>"], "eos_token_id": vocab[EOS],
            "pad_token_id": vocab["<pad>"], "do_sample": False})
    _write_weights(directory / "model.safetensors", kind, config)
    if kind == "embed":
        _write_pooling(directory, hidden)
    _write_json(directory / MODEL_MARKER, {"kind": kind, "context_tokens": CONTEXT_TOKENS})
    return directory


def _config(kind: str, vocab: dict[str, int], layers: int, hidden: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM" if kind == "chat" else "LlamaModel"],
        "model_type": "llama", "vocab_size": len(vocab), "hidden_size": hidden,
        "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "head_dim": hidden // HEADS, "max_position_embeddings": CONTEXT_TOKENS,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": vocab["<s>"], "eos_token_id": vocab[EOS],
        "pad_token_id": vocab["<pad>"], "torch_dtype": "float32", "use_cache": True,
    }


def _write_tokenizer(directory: Path, vocab: dict[str, int]) -> None:
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # characters joined as they are, no spaces between
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(directory / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": EOS, "pad_token": "<pad>",
                "unk_token": "<unk>"}
    # PreTrainedTokenizerFast: the class every transformers version since 4 knows; the
    # template is in both places a version may look for it.
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "additional_special_tokens": list(SPECIALS[4:]),
        "model_input_names": ["input_ids", "attention_mask"], "padding_side": "left",
        "model_max_length": CONTEXT_TOKENS, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE})
    _write_json(directory / "special_tokens_map.json", specials)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _write_weights(path: Path, kind: str, config: dict[str, Any]) -> None:
    """Random weights from a fixed seed, in the parameter names transformers' Llama uses."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED)
    prefix = "model." if kind == "chat" else ""
    shapes = _shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[prefix + name] = torch.ones(shape)
        else:
            tensors[prefix + name] = torch.randn(shape, generator=gen) * INIT_STD
    if kind == "chat":
        head = torch.randn((config["vocab_size"], config["hidden_size"]), generator=gen)
        head *= LM_HEAD_STD
        # Special tokens get logit 0, below the characters' best: greedy text is printable
        # characters that never end by themselves, and sampling rarely picks a special token
        # (the end of turn, then and then, ends a completion early, as a real model's would).
        head[:len(SPECIALS)] = 0.0
        tensors["lm_head.weight"] = head
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Llama decoder stack (`LlamaModel`), by name, in a fixed order."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (hidden, hidden),
            layer + "self_attn.k_proj.weight": (kv, hidden),
            layer + "self_attn.v_proj.weight": (kv, hidden),
            layer + "self_attn.o_proj.weight": (hidden, hidden),
            layer + "mlp.gate_proj.weight": (inner, hidden),
            layer + "mlp.up_proj.weight": (inner, hidden),
            layer + "mlp.down_proj.weight": (hidden, inner),
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["norm.weight"] = (hidden,)
    return shapes


def _write_pooling(directory: Path, hidden: int) -> None:
    """Say "mean pooling, then normalise" the sentence-transformers way, which vLLM (and
    sentence-transformers) read; the transformers backend does the same in code."""
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}], indent=2) + "\n")
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "2_Normalize").mkdir(exist_ok=True)
    _write_json(directory / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True,
        "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    _write_json(directory / "sentence_bert_config.json",
                {"max_seq_length": CONTEXT_TOKENS, "do_lower_case": False})


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    """`python -m e31_worker.workloads.tinymodels DIR --kind chat|embed [--layers --hidden]`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--hidden", type=int, default=HIDDEN,
                        help=f"the width (a multiple of {HEADS})")
    args = parser.parse_args(argv)
    print(build(args.directory, args.kind, layers=args.layers, hidden=args.hidden))


if __name__ == "__main__":
    main()

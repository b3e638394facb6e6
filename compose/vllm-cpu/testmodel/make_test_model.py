"""Make Tollgate's test model and stage it into a Hugging Face cache, as a download would.

The model is a tiny Llama (2 layers, hidden 128, 2 heads of 64, 1 KV head, vocabulary
4096) with random weights from a fixed seed, and a byte-level BPE tokenizer trained on the
corpus beside this file, with a chat template. Same bytes on every machine (the image pins
numpy, tokenizers and safetensors): the same prompt has the same token count everywhere.
Nothing is downloaded.

Beside it, three LoRA adapters for it in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``; on every layer's ``q_proj`` and ``v_proj``, random A and B
matrices from seeds of their own, so each answers differently from the base and from the
others), staged as ``<repo>-lora-a``, ``-lora-b`` (rank 8) and ``-lora-c`` (rank 16: an
engine started with ``--max-lora-rank 8`` refuses it, as it refuses a real adapter too wide
for its slots).

The result is written in the hub cache's own layout (``hub/models--<org>--<name>/`` with
``blobs/``, ``snapshots/<revision>/`` and ``refs/main``), so an engine started with
``HF_HUB_OFFLINE=1`` and the repository id finds it exactly as it finds a staged model.

    python3 make_test_model.py --cache /root/.cache/huggingface [--repo tollgate-test/tiny-llama]
    python3 make_test_model.py --folder /tmp/tiny-llama     # a plain model folder instead
    python3 make_test_model.py --folder /tmp/lora-a --adapter a   # one adapter's folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt"
DEFAULT_REPO = "tollgate-test/tiny-llama"
SEED = 20261127

VOCAB = 4096
HIDDEN = 128
INTERMEDIATE = 256
LAYERS = 2
HEADS = 2  # head_dim 64: vLLM's CPU attention refuses 16
KV_HEADS = 1
CONTEXT = 2048

# LoRA adapters: name -> seed of their random matrices, and rank.
ADAPTERS = {"a": SEED + 1, "b": SEED + 2, "c": SEED + 3}
ADAPTER_RANKS = {"a": 8, "b": 8, "c": 16}
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
LORA_SCALE = 0.2  # standard deviation of A and B: a change a greedy reply shows at once

BOS, EOS = "<s>", "</s>"
SPECIAL = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE over the fixed corpus, one thread so merges never depend on timing."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def weights(vocab: int) -> dict[str, np.ndarray]:
    """Random float32 weights in Llama's tensor names; normal(0, 0.02), norms at one."""
    rng = np.random.Generator(np.random.PCG64(SEED))
    head_dim = HIDDEN // HEADS

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype("<f4")

    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN)}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = np.ones(HIDDEN, dtype="<f4")
        tensors[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype="<f4")
    tensors["model.norm.weight"] = np.ones(HIDDEN, dtype="<f4")
    tensors["lm_head.weight"] = normal(vocab, HIDDEN)
    return tensors


def config(tokenizer: Tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "torch_dtype": "float32",
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT,
        "chat_template": CHAT_TEMPLATE,
    }


def write_folder(folder: Path) -> None:
    """The model's files into ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    dump = lambda name, value: (folder / name).write_text(  # noqa: E731
        json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    dump("config.json", config(tokenizer))
    dump("tokenizer_config.json", tokenizer_config())
    dump("special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS})
    dump(
        "generation_config.json",
        {"bos_token_id": tokenizer.token_to_id(BOS), "eos_token_id": tokenizer.token_to_id(EOS)},
    )
    save_file(weights(tokenizer.get_vocab_size()), str(folder / "model.safetensors"))


def adapter_weights(seed: int, rank: int) -> dict[str, np.ndarray]:
    """PEFT's tensor names and shapes: lora_A (rank × in), lora_B (out × rank)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    head_dim = HIDDEN // HEADS
    out_features = {"q_proj": HEADS * head_dim, "v_proj": KV_HEADS * head_dim}

    def normal(*shape: int) -> np.ndarray:
        scale = np.float32(LORA_SCALE)
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype("<f4")

    tensors = {}
    for layer in range(LAYERS):
        for target in LORA_TARGETS:
            p = f"base_model.model.model.layers.{layer}.self_attn.{target}."
            tensors[p + "lora_A.weight"] = normal(rank, HIDDEN)
            tensors[p + "lora_B.weight"] = normal(out_features[target], rank)
    return tensors


def adapter_config(base: str, rank: int) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_adapter(folder: Path, name: str, base: str) -> None:
    """Adapter ``name``'s files into ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps(adapter_config(base, ADAPTER_RANKS[name]), indent=2, sort_keys=True) + "\n",
        encoding="utf-8",
    )
    tensors = adapter_weights(ADAPTERS[name], ADAPTER_RANKS[name])
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def digest(folder: Path) -> str:
    """One SHA-256 over every file's name and bytes: the model's identity."""
    total = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        total.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return total.hexdigest()


def stage(folder: Path, cache: Path, repo: str) -> Path:
    """Copy ``folder`` into the hub cache layout; the revision is the model's digest."""
    revision = digest(folder)[:40]
    root = cache / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.iterdir()):
        blob = root / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision, encoding="ascii")
    return snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cache", type=Path, help="a Hugging Face cache (HF_HOME) to stage into")
    where.add_argument("--folder", type=Path, help="a plain folder to write the model into")
    parser.add_argument("--repo", default=DEFAULT_REPO, help="repository id in the cache")
    parser.add_argument(
        "--adapter", choices=sorted(ADAPTERS), help="with --folder: this adapter, not the model"
    )
    args = parser.parse_args(argv)
    if args.folder:
        if args.adapter:
            write_adapter(args.folder, args.adapter, args.repo)
        else:
            write_folder(args.folder)
        print(f"{args.folder} {digest(args.folder)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write_folder(Path(tmp) / "model")
        snapshot = stage(Path(tmp) / "model", args.cache, args.repo)
        print(f"{args.repo} {snapshot.name} {digest(Path(tmp) / 'model')}")
        for name in sorted(ADAPTERS):
            folder, repo = Path(tmp) / f"lora-{name}", f"{args.repo}-lora-{name}"
            write_adapter(folder, name, args.repo)
            snapshot = stage(folder, args.cache, repo)
            print(f"{repo} {snapshot.name} {digest(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

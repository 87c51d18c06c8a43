"""Build the tiny deterministic Llama model + byte-level BPE tokenizer used by the
real-vLLM tests, entirely locally (no model hub).

Run with the vLLM venv's python (it needs torch, transformers, tokenizers):

    $VLLM_VENV/bin/python tests/real_vllm/make_model.py DIR

Idempotent: if DIR already has config.json, the weights and the tokenizer, it does nothing.
The weights are random (torch.manual_seed(0)), so the generated text is nonsense: tests must
compare token ids, not text. Prints DIR on the last line of stdout.
"""

from __future__ import annotations

import os
import sys
import tempfile

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A router sends the prompt to a prefill engine and the rest to a decode engine.",
    "Prefill computes the key value cache; decode reads it and writes one token at a time.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 2048.",
    "Once upon a time there was a tiny model that only knew random words.",
    "user: what is the capital of France? assistant: Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    '{"model": "tiny", "prompt": "hi", "max_tokens": 8, "temperature": 0}',
    "Streaming sends server-sent events; each event is a JSON chunk ending with [DONE].",
    "In the beginning the engines were cold, and the router waited for their health checks.",
    "Blocks of keys and values travel over the loopback interface from one process to another.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "Peter Piper picked a peck of pickled peppers. How many pickled peppers did he pick?",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday make a week.",
    "January February March April May June July August September October November December",
    "Red orange yellow green blue indigo violet black white grey brown pink purple silver gold",
    "import os, sys, json; print(json.dumps({'ok': True, 'items': [1, 2, 3]}))",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name LIMIT 10;",
    "ERROR 500: internal server error; WARNING: retrying in 5 seconds; INFO: request done.",
]
# Plus number words, so that the BPE trainer reaches VOCAB_SIZE merges deterministically.
CORPUS += [" ".join(str(n) for n in range(i, i + 50)) for i in range(0, 2000, 50)]

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]
VOCAB_SIZE = 1024

# One line of Jinja; messages are joined with role prefixes, generation prompt optional.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_complete(out_dir: str) -> bool:
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(out_dir, name))

    return (
        has("config.json")
        and any(has(w) for w in WEIGHT_FILES)
        and all(has(t) for t in TOKENIZER_FILES)
    )


def build(out_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # --- tokenizer: byte-level BPE ---
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE

    # --- model: tiny random Llama ---
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # must be one the CPU attention backend supports (32, 64, 80, ...)
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)

    # Write to a temp dir next to the target, then rename: a half-built dir is never seen.
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.isdir(out_dir):
        # incomplete leftover: replace it
        import shutil

        shutil.rmtree(out_dir)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # someone else finished first
        if not is_complete(out_dir):
            raise


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    out_dir = os.path.abspath(argv[1])
    if is_complete(out_dir):
        print(f"[make_model] reusing {out_dir}", file=sys.stderr)
    else:
        build(out_dir)
        print(f"[make_model] built {out_dir}", file=sys.stderr)
    print(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The tiny checkpoints' tokenizer: a byte-level BPE of exactly ``vocab_size`` ids, built offline.

Gemma 4's special-token strings come first (with Gemma 4's leading ids), then the 256 byte symbols,
merges learnt from a fixed sentence and ``<unusedN>`` fillers, so that ``len(tokenizer) ==
vocab_size``; nothing can be downloaded in the test environment.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

#: Special tokens, in id order, with Gemma 4's strings and leading ids (pad 0, eos 1, bos 2,
#: unk 3, mask 4). Multimodal ids are remapped into the tiny vocab and written to config.json.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|video|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|turn>",
    "<turn|>",
)
TOKEN_ID = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
PAD_ID, EOS_ID, BOS_ID = TOKEN_ID["<pad>"], TOKEN_ID["<eos>"], TOKEN_ID["<bos>"]
#: Named special tokens exposed as tokenizer attributes (``tok.image_token_id`` ...), as in Gemma 4.
NAMED_SPECIALS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "video_token": "<|video|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
}
#: Smallest vocab the byte-level tokenizer fits in: the specials plus all 256 bytes.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

#: Fixed corpus the tokenizer's BPE merges are learnt from: a fixed text gives fixed merges.
_MERGE_CORPUS = (
    "the quick brown fox jumps over the lazy dog. the model converts the weights of the experts "
    "and the layers into the other format and then back again, and the result is the same. "
    "in the beginning there is the tokenizer, then the embedding, then the attention, then the "
    "mixture of experts, and at the end there is the norm and the head that gives the logits."
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (the alphabet of byte-level BPE), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _learn_merges(words: Iterable[str], budget: int) -> list[tuple[str, str]]:
    """Plain BPE on a fixed word list; ties break lexicographically so the result is fixed."""
    corpus: dict[tuple[str, ...], int] = {}
    for w in words:
        corpus[tuple(w)] = corpus.get(tuple(w), 0) + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < budget:
        counts: dict[tuple[str, str], int] = {}
        for symbols, freq in corpus.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + freq
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < 2:
            break
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, freq in corpus.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + freq
        corpus = merged
    return merges


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids, built offline.

    Saved through ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5), which
    writes ``tokenizer.json`` + ``tokenizer_config.json`` that ``AutoTokenizer`` loads.

    Ids: Gemma 4's special tokens first (pad 0, eos 1, bos 2, ...), then the 256 byte symbols,
    then merges learnt from a fixed sentence, then ``<unusedN>`` fillers (Gemma has those too).
    BOS is prepended like Gemma's tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}")
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = [w for w, _ in pre.pre_tokenize_str(_MERGE_CORPUS)]
    merges = _learn_merges(words, vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    fillers = [f"<unused{i}>" for i in range(vocab_size - len(vocab))]
    for tok in fillers:
        vocab[tok] = len(vocab)
    assert len(vocab) == vocab_size

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=False))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *fillers)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        extra_special_tokens=dict(NAMED_SPECIALS),
        padding_side="left",
        model_max_length=4096,
    )

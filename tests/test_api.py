"""The public API in three lines, on a tiny model with a byte tokenizer, and a local-path load."""

import torch

import specdec


def test_three_line_api_on_a_tiny_model():
    target = specdec.load_target("tiny-llama")
    drafter = specdec.drafters.build("ngram", target=target)
    out = specdec.generate(target, drafter, "Why is the sky blue?", shape="chain(4)", max_new_tokens=16,
                           temperature=0.0, seed=0)
    assert isinstance(out.token_ids, list) and all(isinstance(t, int) for t in out.token_ids)
    assert 1 <= len(out.token_ids) <= 16
    assert out.text == target.decode(out.token_ids)
    stats = out.stats
    assert stats.mean_acceptance_length == 1 + stats.mean_accepted_tokens
    plain = specdec.generate(target, None, "Why is the sky blue?", max_new_tokens=16)
    assert plain.token_ids == out.token_ids
    assert plain.stats.mean_acceptance_length == 1.0
    summary = stats.summary()
    assert summary["steps"] == stats.num_steps and summary["new_tokens"] == len(out.token_ids)
    assert len(summary["acceptance_rate_by_depth"]) <= 4


def test_shape_config_objects_are_accepted():
    target = specdec.tiny_target("qwen2", vocab_size=64, dtype=torch.float64)
    a = specdec.generate(target, specdec.drafters.build("small", target=target), [1, 2, 3],
                         shape=specdec.TreeShape((2, 2)), max_new_tokens=8, stop_on_eos=False)
    b = specdec.generate(target, specdec.drafters.build("small", target=target), [1, 2, 3],
                         shape="tree(2,2)", max_new_tokens=8, stop_on_eos=False)
    assert a.token_ids == b.token_ids


def test_local_directory_with_the_embedded_tokenizer_loads(tmp_path):
    """Any HF causal LM directory loads: a tiny Mistral saved with the embedded tokenizer."""
    from transformers import AutoTokenizer

    from specdec.loading import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    tiny = specdec.tiny_target("mistral", vocab_size=len(tokenizer), hidden_size=16)
    tiny.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    target = specdec.load_target(str(tmp_path))
    assert target.vocab_size == len(tokenizer) and target.tokenizer.chat_template
    ids = target.encode_prompt("Hello there")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "Hello there" in text
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    out = specdec.generate(target, specdec.drafters.build("ngram", target=target), "Hello there", max_new_tokens=5)
    assert len(out.token_ids) <= 5


def test_building_an_early_exit_drafter_leaves_the_target_intact():
    """Regression: the early-exit copy once truncated the target's own layer list."""
    target = specdec.tiny_target("llama", vocab_size=64, num_layers=4, dtype=torch.float64)
    before = specdec.generate(target, None, [1, 2, 3], max_new_tokens=6, stop_on_eos=False).token_ids
    drafter = specdec.drafters.build("small", target=target, layers=1)
    assert len(target.model.model.layers) == 4 and target.model.config.num_hidden_layers == 4
    assert len(drafter.model.model.model.layers) == 1
    assert specdec.generate(target, None, [1, 2, 3], max_new_tokens=6, stop_on_eos=False).token_ids == before


def test_no_progress_bars_silences_the_gguf_reader_bar(capfd):
    """The first load converts the embedded GGUF file; transformers' GGUF reader draws a plain tqdm
    bar that its own progress-bar switch does not reach. Inside `no_progress_bars` it draws nothing,
    and the reader's tqdm is restored after."""
    import transformers.modeling_gguf_pytorch_utils as reader

    from specdec.quiet import no_progress_bars

    with no_progress_bars():
        list(reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" not in capfd.readouterr().err
    list(reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert "Converting" in capfd.readouterr().err

"""Models: finding and loading one (`models`, `loader`, GGUF files through `gguf`), its
tokenizer and chat template, what JustFit changes in how its mlx-lm modules run
(`adapter`, `native_layers`), and perplexity. Nothing is imported here: import the
module that owns a name."""

"""GGUF support: `file` reads the container, `blocks` translates block quantizations
into MLX's affine format, `tokenizer` rebuilds the tokenizer from metadata, `convert`
turns the whole into an mlx-lm model folder and `cache` keeps the folders, converting
on first use."""

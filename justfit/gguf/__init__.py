"""GGUF support: `file` reads the container, `blocks` translates block quantizations
into MLX's affine format, `tokenizer` rebuilds the tokenizer from metadata, and
`convert` turns the whole into a cached mlx-lm model folder."""

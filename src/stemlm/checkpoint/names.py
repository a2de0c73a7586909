"""The file names of a model folder, in one module so that every reader and writer of the format agrees on them."""

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"  # what transformers' AutoTokenizer reads beside tokenizer.json
SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"  # the same special tokens, for readers of the older layout
# The token a folder's tokenizer files name as eos: stemlm.data.tokenizer.EOT_TOKEN, the document separator stemlm
# trains with and stops generating on (spelled here because the format sits below the data layer;
# tests/hf/test_hf_tokenizer_files.py reads the written files against EOT_TOKEN).
EOS_TOKEN = "<|endoftext|>"

"""Converting models: retrofitting a dense model into STEM, importing GGUF and official STEM checkpoints, writing
Llama folders, table dtypes.

Modules: `retrofit` (the table initialisations and the adapter retrofit), `driver` (`convert_checkpoint`, the
`stemlm convert --stem-layers` pipeline), `gguf` (a GGUF file into a Llama folder), `official` (a checkpoint of the
official STEM trainer into a stemlm folder), `llama` (a dense model written as a Hugging Face Llama folder),
`table_dtype` (compact int8/bf16 table storage of a checkpoint).
"""

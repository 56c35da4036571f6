"""What several test modules share, other than fixtures of the whole session (those are in
tests/conftest.py): no test module imports another (tests/test_import_order.py checks it).

- cli: run `quantize` in-process and check its one-line refusals;
- engine: random-weight models, prompts and greedy decoding through the engine and transformers;
  the quantized variants the engine's tests load;
- gptqmodel: GPTQModel's anchor venv and its read-back of our GPTQ/AWQ files;
- llama_cpp_scores: llama.cpp's perplexity and added KL divergence of a GGUF file;
- processes: processes a test tagged, to check none is left behind;
- ggml_oracle: llama.cpp's own quantizer, the byte-exact reference;
- ggml_cases: seeded inputs, importance matrices and the block-by-block comparison of the
  ggml encoders' byte-exactness tests;
- model_zoo: small random models of each architecture; smollm2: a real pretrained checkpoint;
- fuzz_inputs: the seeded fuzzer of the commands that read users' files (also a script);
- browser: a headless chromium's view of a report page;
- serving: `quantize serve` in a process of its own, with its pid; hostile_client: a client process
  that sends it hostile bodies (also a script).
"""

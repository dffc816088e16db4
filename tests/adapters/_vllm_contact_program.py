"""A new user's first program with vLLM in its own process, run by test_vllm_contact.py as its own process:
``python _vllm_contact_program.py CALL ARG``. ``CALL`` is ``connect`` (``VLLMServerEngine.connect(ARG)``),
``launch`` or ``start_async`` (of the model directory ``ARG``), or ``served_config`` (print, as JSON, the
config of the model the server at ``ARG`` serves). It prints how long the call took
(``call took S s``) on stderr before the error, if any, ends the program.
"""

from __future__ import annotations

import json
import sys
import time

from hybridmem.adapters.vllm.server import VLLMServerEngine

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256"]

if __name__ == "__main__":
    call, arg = sys.argv[1], sys.argv[2]
    start = time.monotonic()
    try:
        if call == "connect":
            VLLMServerEngine.connect(arg)
        elif call == "launch":
            VLLMServerEngine.launch(arg, server_args=SERVER_ARGS)
        elif call == "start_async":
            VLLMServerEngine.start_async(arg, dtype="float32", max_model_len=256, skip_tokenizer_init=True)
        elif call == "served_config":
            from hybridmem.adapters.vllm.server.client import HTTPClient
            from hybridmem.adapters.vllm.server.contact import served_config

            print(json.dumps(served_config(HTTPClient(arg)).to_dict()))
        else:
            raise SystemExit(f"unknown call {call!r}")
    finally:
        print(f"call took {time.monotonic() - start:.3f} s", file=sys.stderr, flush=True)

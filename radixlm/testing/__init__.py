"""Helpers shared by the tests, the benchmarks and the DSL's `Runtime` (shipped with the package).

    radixlm.testing.server   launch_server_process / ServerProcess: the real server as a child
                             process on a free loopback port; process-tree helpers (/proc)
    radixlm.testing.models   the ChatML special tokens, stdlib training text, and a byte-level BPE
                             tokenizer trainer used to synthesize offline test models

Nothing here is imported by the runtime itself.
"""

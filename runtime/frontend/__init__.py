"""Pure building blocks of the OpenAI-compatible HTTP frontend (no server, no sockets).

- ``protocol``: validate ``/v1/completions`` and ``/v1/chat/completions`` bodies into a
  frozen ``GenerationRequest`` or a ``RequestError`` carrying the OpenAI error shape.
- ``tokenizer``: the model directory's tokenizer (encode with BOS policy, decode, EOS ids).
- ``detokenizer``: per-request incremental detokenization with stop strings held back
  until they are disambiguated.
- ``chat``: the model's jinja chat template (or ``--chat-template``'s), or a documented
  fallback.
- ``defaults``: request defaults from the model's ``generation_config.json``.

The modules import only ``tokenizers``, ``jinja2`` and the transport's schema (no torch);
the server wires them to the engine.
"""

"""Request preparation (JSON parsing, validation, chat templates, tokenization) kept
off the frontend's event loop, and the size limits that bound it.

Parsing JSON and tokenizing hold the GIL, so a thread does not help: while a
30 MB body is parsed and tokenized, every open stream and /health wait.  Here a
body is prepared in one of two places:

- inline, on the event loop, when it is small (at most ``INLINE_BODY_BYTES``)
  and cheap (its text times its chat messages, the tokenizer's work, at most
  ``INLINE_COST``): most requests, at no extra latency;
- otherwise in a :class:`~.pool.PreprocessPool` worker, a ``python -m
  runtime.frontend.preprocess`` process (``--preprocess-workers``, default 2)
  that loaded the tokenizer, the chat template and the defaults once.  It gets the
  raw body bytes and answers the validated request(s) or the RequestError, as
  msgpack (nothing is pickled across processes; the frontend checks each field
  of the answer, :func:`~.wire.requests_from_wire`).  /tokenize and /detokenize get
  their finished JSON response from it.

A worker runs at a lower CPU priority (``nice`` +10): a large body never takes
the CPU from the event loop, the coordinator or the ranks.  It is never wedged:
a job that runs over ``PREPARE_TIMEOUT_S`` is a 413 and the worker is killed and
replaced.  Its memory comes back: after a large job
it collects garbage and hands freed heap pages back (``malloc_trim``), and one
whose RSS still grew by more than ``RECYCLE_GROWTH_BYTES`` over its start is
replaced.  When every worker is busy, at most ``MAX_QUEUED_PER_WORKER`` large
requests per worker wait (each holds its body); beyond, 503 with Retry-After.

Size limits bound the work a body may cause before any tokenizing (:mod:`.limits`).

Modules, one concept each:

- ``limits``: the size limits (:func:`~.limits.check_sizes`) and the inline cost;
- ``preparer``: parsing, validation and tokenizing (:class:`~.preparer.Preparer`),
  and :func:`~.preparer.prepare_body`, which picks inline or the pool;
- ``pool``: the frontend's side, :class:`~.pool.PreprocessPool`;
- ``worker``: the worker process (``__main__`` runs it);
- ``images``: decoding a chat request's images with Pillow against hostile ones
  (every body with an image part is prepared in a worker);
- ``image_processor``: a ``preprocessor_config.json`` read and applied;
- ``wire``: the frames and the checked msgpack form of requests (their images'
  pixels as bytes, shape and dtype) and errors;
- ``memory``: handing a large body's heap pages back (``malloc_trim``), RSS.
"""

"""Validation of ``POST /v1/completions`` and ``POST /v1/chat/completions`` bodies.

``parse_completion(body, limits, tokenizer)`` and ``parse_chat(body, limits, tokenizer,
template)`` turn a decoded JSON body into a frozen ``GenerationRequest`` (prompt token
ids plus everything the engine and the response writer need), or raise ``RequestError``
with the HTTP status and the OpenAI error body (``to_json()``), naming the bad field in
``param``. Plain code rather than pydantic: each check names its field exactly, and
booleans are never taken for integers.

Accepted fields (null means "not given"; unknown fields are ignored, as OpenAI does):

- ``model``: the served model's name (default); another name is a 404
  ``model_not_found`` naming ``model``.
- completions ``prompt``: a non-empty string, a list of one string, or a non-empty list
  of token ids in ``[0, vocab_size)``. Text is encoded with the tokenizer's special
  tokens (a BOS where the tokenizer adds one). ``parse_completions`` also takes a
  batch: a list of such prompts (strings or token-id lists), one request each.
- chat ``messages``: a non-empty list of ``{"role": "system"|"user"|"assistant",
  "content": str | [{"type": "text", "text": str}, ...]}``; text parts are joined with
  "\\n" (as vLLM does). The prompt is the chat template's rendering (a template
  that loops over a message's content gets the parts, vLLM's "openai" content
  format). ``image_url`` parts (base64 data URIs only; a remote URL is a 400
  naming it) leave ``IMAGE_PLACEHOLDER`` in the text and are decoded by the
  preprocessing worker into ``GenerationRequest.images``; a text-only model then
  refuses them. A vision model (LLaVA) gets each placeholder expanded into its
  image tokens (``image_prompt``), one ``GenerationRequest.image_spans`` entry per
  image, and refuses the placeholder typed in text (docs/serving.md "Images").
- ``max_tokens`` (chat also ``max_completion_tokens``, which wins): an int >= 1. Default:
  the rest of the context, capped by ``ServingLimits.default_max_tokens`` when set.
- ``temperature`` (finite, >= 0, default 1.0; 0 is greedy), ``top_p`` (0 < p <= 1),
  ``top_k`` (int >= -1; 0 and -1 disable it and are returned as -1), ``seed`` (0 <= seed
  < 2**63, or null for a random one), ``n`` (1..16).
- ``stop``: a non-empty string or a list of at most 16; ``stop_token_ids``: ids in
  ``[0, vocab_size)``.
- completions ``logprobs``: int 0..20, the number of top alternatives per token; chat
  ``logprobs: bool`` with ``top_logprobs`` 0..20 (which needs ``logprobs: true``). Both
  end up as ``GenerationRequest.logprobs`` (None: no logprobs).
- ``cache_salt`` (vLLM): a non-empty string of at most 256 characters; requests share
  prefix-cache pages only with requests of an equal salt (null or absent: no salt).
  With several API keys the server adds each key's own salt
  (``runtime.frontend.server.auth``).
- ``stream``, ``stream_options.include_usage`` (stream_options only with stream: true),
  ``ignore_eos`` (vLLM), ``min_tokens`` (0..max_tokens, vLLM).
- completions ``echo`` (the prompt's text, and with ``logprobs`` its tokens' log
  probabilities, before the completion; ``max_tokens: 0`` returns the prompt alone)
  and vLLM's ``prompt_logprobs`` (0..20, both routes): scored prefill,
  docs/scored-prefill.md. Chat's ``echo: true`` is a 400 naming ``echo``.
- vLLM's output fields: ``include_stop_str_in_output`` (bool, default false: the stop
  string that ends a choice is part of its text), ``skip_special_tokens`` (bool, default
  true: special tokens are left out of the text; ``spaces_between_special_tokens: false``
  is refused with it false), ``return_tokens_as_token_ids`` (bool: logprobs name tokens
  ``"token_id:{id}"``).
- ``truncate_prompt_tokens`` (vLLM): k >= 1 keeps only the prompt's last k tokens (chat:
  of the rendered prompt); -1 keeps as many as leave room for max_tokens (for one token
  when max_tokens is not given, or the default max_tokens cap when there is one). k over
  the context less an explicit max_tokens is a 400 naming it. Each prompt of a batch is
  truncated on its own; ``prompt`` is then None (the ids are no longer its text's).
- ``add_special_tokens`` (vLLM): completions default true (the tokenizer's special
  tokens, a BOS where it adds one); chat default the template's (false for a model's
  template, which writes the BOS itself). Chat ``add_generation_prompt`` (default true).
- ``logit_bias``: an object of at most 300 token-id strings (ids in ``[0, vocab_size)``)
  to biases in [-100, 100]; ``presence_penalty`` and ``frequency_penalty`` in [-2, 2];
  ``repetition_penalty`` > 0 (vLLM; 1 is off). They reach the ranks in
  ``SamplingParams``.
- Fields the runtime does not implement are a 400 naming the field, never ignored:
  ``best_of`` > n, ``suffix``, ``use_beam_search: true``, guided decoding
  (``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
  ``structured_outputs``), ``response_format`` other than ``{"type": "text"}``,
  non-empty ``tools`` or ``functions``, a ``tool_choice`` / ``function_call`` that asks
  for a call, ``min_p`` other than 0. Their no-op forms pass: ``best_of`` <= n,
  ``suffix: ""``, ``use_beam_search: false``, ``response_format: {"type": "text"}``,
  ``tools: []``, ``tool_choice: "none"`` (or ``"auto"``, which with no tools calls none).
  Likewise vLLM's ``prompt_logprobs`` -1 (the whole vocabulary), ``structural_tag``,
  ``allowed_token_ids``, ``bad_words`` (``[]`` passes),
  ``prompt_embeds``, ``logits_processors`` (``[]``), ``vllm_xargs`` (``{}``),
  ``kv_transfer_params`` (``{}``), ``priority`` (0), ``return_token_ids`` (false),
  ``stream_options.continuous_usage_stats`` (false), the repetition-pattern stop
  (``max_repetition_pattern_size``, ``min_repetition_pattern_size``,
  ``repetition_min_count``: 0) and the chat template's inputs ``chat_template``,
  ``chat_template_kwargs`` (``{}``), ``documents``, ``reasoning_effort`` and
  ``continue_final_message`` (false). ``docs/serving.md`` ("vLLM request fields") lists
  every field of vLLM's two request models and what flare does with it.

Defaults: a field the request leaves out takes the model's ``generation_config.json``
value (``GenerationDefaults``, see ``runtime.frontend.defaults``), else flare's. The
model's EOS ids are stop token ids unless ``ignore_eos``.

Choices: prompts x n may not exceed ``ServingLimits.max_choices`` (a 400 naming ``n``,
or ``prompt`` when n is 1).

Context: a prompt that leaves no room for one output token (``len(prompt) >=
max_context``) is an error naming ``prompt`` (``messages`` for chat); prompt plus an
explicit ``max_tokens`` over ``max_context`` is an error naming the max-tokens field.
Both carry the code ``context_length_exceeded``.

Modules, one concept each: ``completions``, ``chat_completions`` and ``tokens`` (the
``/tokenize`` and ``/detokenize`` bodies) parse each endpoint's body; ``generation``
checks the fields the generation endpoints share; ``vllm`` refuses the fields flare
does not implement; ``build`` applies the context checks and assembles the request;
``fields`` checks single JSON values; ``images`` checks image parts and holds
``ImageLimits`` and ``PreparedImage``; ``image_prompt`` expands a vision model's
image placeholders into its image tokens and spans; ``requests`` holds ``ServingLimits`` and
``GenerationRequest``; ``errors`` holds ``RequestError``.
"""

"""Speech to text outside the engine: audio decoding, log-mel features, the long-audio split, Whisper's decoder
prompts and the transcript's segments and response formats (``docs/audio.md``). The engine sees only
``{"prompt_token_ids", "audio_features"}`` prompts."""

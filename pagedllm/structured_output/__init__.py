"""Structured outputs: constrain sampling to a JSON schema, a regex, a choice or a grammar (xgrammar).

``params`` (no torch) is what requests carry; ``backend`` compiles grammars and builds matchers (xgrammar,
imports torch); ``manager`` owns the compile cache, the compile thread pool and one matcher per running
request, and fills the per-step token bitmask. The scheduler only sees ``RequestStatus.WAITING_FOR_GRAMMAR``.
"""

"""Structured outputs: generations held to a JSON schema, a regex, a list of choices or a grammar.

`grammars` turns a constraint (`SamplingParams.structured_outputs`) into an llguidance grammar and validates
it, torch-free, for the web tier as well as the engine; `engine` compiles grammars and fills each step's
token masks for the engine.
"""

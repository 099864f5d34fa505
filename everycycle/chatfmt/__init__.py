"""Chat formatting: conversations into prompts, and a model's output back into its
answer, thinking and tool calls. Pure Python, no llama.cpp; imports only the ground
(protocol, errors). The daemon and the engine both import it.

chat.py            a model's chat: its template compiled once, the prompt it renders, and
                   the thinking and tool-call formats that prompt implies (``ChatPrompt``)
chatoutput.py      one request's output split as it streams: answer, thinking, tool calls
template.py        the sandboxed Jinja environment that renders a GGUF's chat template as
                   Hugging Face transformers does
templatebudget.py  a render's budget of time, operations and bytes
tools.py           tool-call formats (Hermes, Llama 3, Mistral, ...) and their system
                   prompts
callgrammar.py     the grammar that holds a model to a well-formed call of a tool list,
                   each schema compiled lenient, once per list
schemacheck.py     what the constraint engine does not enforce: its place (a JSON pointer),
                   the refusal, and a call's arguments checked after generation
toolparse.py       tool calls parsed out of the output, whole or streamed
jsonscan.py        JSON read as it streams in (where a value ends, a string's text so far)
reasoning.py       thinking markers found in templates, and thinking split from the answer
constraint.py      structured output: a JSON Schema, GBNF or Lark text to llguidance's
                   grammar (compiled without a vocabulary; what is refused, and why)
"""

"""KV cells kept beyond a slot: the prompt cache in host RAM spilled to disk
(``promptcache``, ``kvdisk``) and the token cache for long chat prompts."""

"""Small pieces every layer may use: process exits, the msgpack codec. They import nothing of ours."""

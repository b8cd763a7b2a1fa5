from llmserve.triton.model import TritonPythonModel  # noqa: F401

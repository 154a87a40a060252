"""The shortest correct use of VarRateCache with generate(): the README's snippet, as a file."""

from hf_varrate import VarRateCache
from hf_varrate.models import load_default_model

model, tokenizer = load_default_model("smollm2-135m-instruct")  # or any Llama / Qwen / Gemma-3 model
cache = VarRateCache.from_pretrained("smollm2-135m-instruct", budget=0.2)  # bases shipped with the package

messages = [{"role": "user", "content": "Summarise in one sentence: " + "The quick brown fox jumps. " * 200}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, cache=cache, max_new_tokens=40, do_sample=False)  # past_key_values= before 5.24

print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(cache.footprint())  # bytes stored vs a DynamicCache of the same tokens

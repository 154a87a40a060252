"""The shortest correct use of VarRateCache with generate()."""

from hf_varrate import VarRateCache
from hf_varrate.models import load_default_model

model, tokenizer = load_default_model("smollm2-135m-instruct")
cache = VarRateCache.from_pretrained("hub_assets/smollm2-135m-instruct", model=model,
                                     budget=0.2)  # the recommended preset; preset="paper": the paper's defaults

messages = [{"role": "user", "content": "Summarise in one sentence: " + "The quick brown fox jumps. " * 200}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, past_key_values=cache, max_new_tokens=40, do_sample=False)

print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(cache.footprint())

// The sampling fields people touch, shared by the chat and side-by-side views.

const FIELDS = [
  { name: "max_tokens", label: "max_tokens", step: "1", min: "1" },
  { name: "temperature", label: "temperature", step: "0.05", min: "0" },
  { name: "top_p", label: "top_p", step: "0.05", min: "0", max: "1" },
  { name: "seed", label: "seed", step: "1", placeholder: "random" },
];

// Fill `fieldset` with the fields, ids prefixed by `prefix`, values from `defaults`.
export function mountSampling(fieldset, prefix, defaults) {
  for (const field of FIELDS) {
    const input = document.createElement("input");
    input.type = "number";
    input.id = `${prefix}-${field.name}`;
    for (const attr of ["step", "min", "max", "placeholder"]) {
      if (field[attr]) input.setAttribute(attr, field[attr]);
    }
    input.value = defaults[field.name] ?? "";
    fieldset.append(labelled(field.label, input));
  }
  const stop = document.createElement("input");
  stop.type = "text";
  stop.id = `${prefix}-stop`;
  stop.placeholder = "e.g. \\n\\n, END";
  stop.title = "Stop strings, separated by commas; \\n is a newline";
  stop.value = defaults.stop ?? "";
  fieldset.append(labelled("stop", stop));
}

function labelled(text, input) {
  const label = document.createElement("label");
  label.className = "field";
  label.htmlFor = input.id;
  const span = document.createElement("span");
  span.textContent = text;
  label.append(span, input);
  return label;
}

// The request fields of the filled-in inputs (empty ones are left to the server's defaults).
export function readSampling(prefix) {
  const out = {};
  for (const field of FIELDS) {
    const raw = document.getElementById(`${prefix}-${field.name}`).value.trim();
    if (raw !== "") out[field.name] = Number(raw);
  }
  const stop = document.getElementById(`${prefix}-stop`).value;
  const stops = stop
    .split(",")
    .map((s) => s.replace(/^ +| +$/g, "").replaceAll("\\n", "\n").replaceAll("\\t", "\t"))
    .filter((s) => s !== "");
  if (stops.length) out.stop = stops;
  return out;
}

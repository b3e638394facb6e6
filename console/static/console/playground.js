// Playground: post the conversation, read the relayed event stream, show each reply's stats.
(() => {
  const config = JSON.parse(document.getElementById("pg-config").textContent);
  const chat = document.getElementById("pg-chat");
  const form = document.getElementById("pg-form");
  const input = document.getElementById("pg-input");
  const send = document.getElementById("pg-send");
  const csrf = document.body.getAttribute("hx-headers") ? JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRFToken"] : "";
  let history = [];

  const bubble = (role, text) => {
    const empty = document.getElementById("pg-empty");
    if (empty) empty.remove();
    const el = document.createElement("div");
    el.className = `bubble ${role}`;
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    el.appendChild(body);
    chat.appendChild(el);
    chat.scrollTop = chat.scrollHeight;
    return el;
  };

  const meta = (el, text, isError) => {
    const m = document.createElement("span");
    m.className = "meta";
    if (isError) m.style.color = "var(--bad)";
    m.textContent = text;
    el.appendChild(m);
  };

  const describe = (s) => {
    const parts = [];
    parts.push(s.ttft_ms === null ? "no tokens" : `first token ${s.ttft_ms.toLocaleString()} ms`);
    parts.push(`${s.prompt_tokens.toLocaleString()} prompt + ${s.completion_tokens.toLocaleString()} completion tokens`);
    if (s.tokens_per_s) parts.push(`${s.tokens_per_s} tokens/s`);
    parts.push(`total ${(s.total_ms / 1000).toFixed(2)} s`);
    parts.push(s.cost === null ? "unpriced" : `cost ${s.cost} ${s.currency}`);
    return parts.join(" · ");
  };

  document.getElementById("pg-clear").addEventListener("click", () => {
    history = [];
    chat.innerHTML = "";
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text) return;
    input.value = "";
    send.disabled = true;
    history.push({ role: "user", content: text });
    bubble("user", text);
    const reply = bubble("assistant", "");
    const out = reply.querySelector(".text");
    let answer = "";
    try {
      const response = await fetch(config.url, {
        method: "POST",
        headers: { "Content-Type": "application/json", "X-CSRFToken": csrf },
        body: JSON.stringify({
          tenant: config.tenant, model: document.getElementById("pg-model").value,
          max_tokens: Number(document.getElementById("pg-max").value) || 256, messages: history,
        }),
      });
      if (!response.ok) {
        meta(reply, `Error ${response.status}: ${(await response.text()).slice(0, 200)}`, true);
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const frame = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const kind = (frame.match(/^event: (.*)$/m) || [])[1];
          const data = JSON.parse((frame.match(/^data: (.*)$/m) || [])[1] || "{}");
          if (kind === "delta") { answer += data.text; out.textContent = answer; chat.scrollTop = chat.scrollHeight; }
          else if (kind === "stats") meta(reply, describe(data));
          else if (kind === "error") meta(reply, `Error ${data.status}: ${data.message}`, true);
        }
      }
      if (answer) history.push({ role: "assistant", content: answer });
    } catch (err) {
      meta(reply, `Error: ${err}`, true);
    } finally {
      send.disabled = false;
      input.focus();
    }
  });
})();

/*
 * The browser UI's own behaviour; htmx (from the django-htmx wheel) does the rest.
 *
 * - Answers stream in from their Server-Sent Events (EventSource): text is appended as it
 *   arrives, each [n] becoming a link to its passage, as frontdoors/ui/rendering.py renders a
 *   stored answer. "Stop" closes the connection (the generation itself goes on server-side).
 * - Citation and source links open the passage in a dialog (the link still works without
 *   JavaScript: it is the passage page).
 * - Files dropped on the upload zone are uploaded at once.
 * - The documents' summary line is a live region, updated only when its text changes.
 * - A failed request for the answer panel or an upload says so there.
 *
 * Text from documents and models only ever becomes DOM text nodes, never HTML. The script's
 * own words come from the page, in its language: the JSON of #ui-strings
 * (frontdoors/ui/languages.py, script_strings), through phrase().
 */
"use strict";

(function () {
  const STRINGS = (() => {
    const element = document.getElementById("ui-strings");
    return element ? JSON.parse(element.textContent) : {};
  })();

  // The page's words for `key`, each %(name)s replaced by values[name].
  function phrase(key, values = {}) {
    const words = STRINGS[key] ?? key;
    return words.replace(/%\((\w+)\)s/g, (whole, name) => (name in values ? String(values[name]) : whole));
  }

  // The citation syntax of search/prompting.py (citation_markers): [1], [1, 3], [2-4].
  const CITATION = /\[\s*(\d{1,6}(?:\s*[-\u2013]\s*\d{1,6})?(?:\s*[,;]\s*\d{1,6}(?:\s*[-\u2013]\s*\d{1,6})?)*)\s*\]/g;
  const CITATION_RANGE_MAX = 50; // search.prompting.CITATION_RANGE_MAX
  // An opening bracket at the end of the text so far that more text may make a citation:
  // held back until it is complete, so a link is never split across two deltas.
  const OPEN_CITATION = /\[[\d\s,;\-\u2013]{0,40}$/;

  function citationNumbers(inner) {
    const numbers = [];
    for (const item of inner.trim().split(/\s*[,;]\s*/)) {
      const range = item.match(/^(\d+)\s*[-\u2013]\s*(\d+)$/);
      if (!range) {
        numbers.push(Number(item));
        continue;
      }
      const first = Number(range[1]);
      const last = Number(range[2]);
      if (first <= last && last - first < CITATION_RANGE_MAX) {
        for (let number = first; number <= last; number += 1) numbers.push(number);
      } else {
        numbers.push(first, last);
      }
    }
    return [...new Set(numbers)];
  }

  function citationLink(number, source) {
    const link = document.createElement("a");
    link.className = "cite";
    link.href = source.url;
    link.dataset.passage = "";
    link.title = source.title;
    link.setAttribute("aria-label", phrase("source", { number, title: source.title }));
    link.textContent = String(number);
    return link;
  }

  function appendWithCitations(container, text, sources) {
    let position = 0;
    for (const match of text.matchAll(CITATION)) {
      container.append(text.slice(position, match.index), "[");
      citationNumbers(match[1]).forEach((number, index) => {
        if (index > 0) container.append(", ");
        const source = sources[number];
        container.append(source ? citationLink(number, source) : String(number));
      });
      container.append("]");
      position = match.index + match[0].length;
    }
    container.append(text.slice(position));
  }

  // The stored answer's text with its unsupported sentences marked (their spans index the
  // text in Python characters, that is code points: Array.from, not String.slice).
  function renderChecked(container, text, sentences, sources) {
    const chars = Array.from(text);
    let position = 0;
    for (const sentence of sentences) {
      if (sentence.action !== "unsupported" || sentence.start < position || sentence.end > chars.length) continue;
      appendWithCitations(container, chars.slice(position, sentence.start).join(""), sources);
      const span = document.createElement("span");
      span.className = "unsupported";
      span.title = phrase("unsupported_title");
      appendWithCitations(span, chars.slice(sentence.start, sentence.end).join(""), sources);
      container.append(span);
      position = sentence.end;
    }
    appendWithCitations(container, chars.slice(position).join(""), sources);
  }

  // ------------------------------------------------------------------ streamed answers

  function followAnswer(section) {
    if (section.answerEvents) return;
    const textBox = section.querySelector("[data-answer-text]");
    const status = section.querySelector("[data-answer-status]");
    const stopButton = section.querySelector("[data-answer-stop]");
    const sources = JSON.parse(section.querySelector("script[type='application/json']").textContent);
    const events = new EventSource(section.dataset.answerStream);
    section.answerEvents = events;
    let text = "";
    let shown = 0;

    function show(final) {
      let end = text.length;
      if (!final) {
        const open = text.slice(shown).match(OPEN_CITATION);
        if (open) end = shown + open.index;
      }
      if (end > shown) {
        appendWithCitations(textBox, text.slice(shown, end), sources);
        shown = end;
      }
    }

    function finish(message, state) {
      events.close();
      show(true);
      textBox.setAttribute("aria-busy", "false");
      status.textContent = message;
      section.dataset.state = state;
      if (stopButton) stopButton.hidden = true;
    }

    events.addEventListener("delta", (event) => {
      text += JSON.parse(event.data).text;
      show(false);
      status.textContent = phrase("writing");
    });
    events.addEventListener("progress", (event) => {
      const progress = JSON.parse(event.data);
      status.textContent = phrase("reading", { done: progress.done, total: progress.total });
    });
    events.addEventListener("retry", (event) => {
      const retry = JSON.parse(event.data);
      status.textContent = retry.kind ? phrase("retrying", { kind: retry.kind }) : phrase("retrying_unknown");
    });
    // The generation has ended; its citations are being checked. Then the stored answer
    // replaces what streamed: invented markers gone, citations moved or added, and
    // unsupported sentences marked, as frontdoors/ui/rendering.py renders it.
    events.addEventListener("stats", () => {
      status.textContent = phrase("checking");
    });
    events.addEventListener("answer", (event) => {
      const stored = JSON.parse(event.data);
      textBox.replaceChildren();
      renderChecked(textBox, stored.text, stored.sentences || [], sources);
      text = stored.text;
      shown = text.length;
      const unsupported = (stored.sentences || []).filter((sentence) => sentence.action === "unsupported").length;
      const note = unsupported
        ? ` ${phrase(unsupported === 1 ? "unsupported_one" : "unsupported_other", { counter: unsupported })}`
        : "";
      finish(`${phrase("done")}${note}`, "done");
    });
    events.addEventListener("error", (event) => {
      if (event.data !== undefined) {
        // The stream's own "error" event: the answer failed, with the reason.
        finish(phrase("failed", { reason: JSON.parse(event.data).message }), "failed");
      } else if (events.readyState === EventSource.CLOSED) {
        // The server refused the connection (logged out, or the answer is gone).
        finish(phrase("refused"), "lost");
      } else {
        // The connection dropped: the browser reconnects by itself from the last event id.
        status.textContent = phrase("reconnecting");
      }
    });
    if (stopButton) {
      stopButton.addEventListener("click", () => {
        finish(phrase("stopped"), "stopped");
        textBox.focus();
      });
    }
  }

  // An answer panel replaced by a new question stops listening to the old answer.
  document.addEventListener("htmx:beforeCleanupElement", (event) => {
    if (event.target.answerEvents) event.target.answerEvents.close();
  });

  // ------------------------------------------------------------------ passage dialog

  document.addEventListener("click", (event) => {
    const link = event.target.closest("a[data-passage]");
    const dialog = document.getElementById("passage-dialog");
    if (!link || !dialog || typeof dialog.showModal !== "function" || event.ctrlKey || event.metaKey || event.shiftKey) return;
    event.preventDefault();
    htmx.ajax("GET", link.href, { target: "#passage-dialog-body", swap: "innerHTML" }).then(() => {
      if (!dialog.open) dialog.showModal();
      const hit = dialog.querySelector(".passage-hit");
      if (hit) hit.scrollIntoView({ block: "center" });
    });
  });

  document.addEventListener("click", (event) => {
    const close = event.target.closest("[data-dialog-close]");
    if (close) close.closest("dialog").close();
  });

  // ------------------------------------------------------------------ uploads

  // File names listed the page's language's way ("a, b and c"; "a、b、c").
  const listFormat = new Intl.ListFormat(document.documentElement.lang || undefined, { type: "conjunction" });

  function dropzone(zone) {
    const input = zone.querySelector("input[type='file']");
    const chosen = zone.querySelector("[data-dropzone-chosen]");
    const form = zone.closest("form");
    const describe = () => {
      const names = Array.from(input.files, (file) => file.name);
      chosen.textContent = names.length ? phrase("chosen", { names: listFormat.format(names) }) : "";
    };
    ["dragenter", "dragover"].forEach((type) =>
      zone.addEventListener(type, (event) => {
        event.preventDefault();
        zone.classList.add("is-over");
      }),
    );
    ["dragleave", "drop"].forEach((type) => zone.addEventListener(type, () => zone.classList.remove("is-over")));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      if (!event.dataTransfer.files.length) return;
      input.files = event.dataTransfer.files;
      describe();
      form.requestSubmit();
    });
    input.addEventListener("change", describe);
    form.addEventListener("htmx:afterRequest", (event) => {
      if (event.detail.elt === form && event.detail.successful) {
        input.value = "";
        describe();
      }
    });
  }

  // ------------------------------------------------------------------ failed requests

  // htmx leaves the page as it was on a server error or a lost connection: say so where the
  // result was expected (a failed poll of the documents table just tries again next second).
  function requestFailed(event) {
    const target = event.detail.target;
    if (!target || !target.matches("#answer-panel, #upload-report")) return;
    const alert = document.createElement("p");
    alert.className = "error";
    alert.setAttribute("role", "alert");
    const status = event.detail.xhr && event.detail.xhr.status;
    alert.textContent = status ? phrase("server_failed", { status }) : phrase("unreachable");
    target.replaceChildren(alert);
  }
  document.addEventListener("htmx:responseError", requestFailed);
  document.addEventListener("htmx:sendError", requestFailed);

  // ------------------------------------------------------------------ wiring

  function documentSummary(list) {
    const live = document.getElementById("document-summary");
    if (live && live.textContent !== list.dataset.summary) live.textContent = list.dataset.summary;
  }

  function within(root, selector) {
    const found = Array.from(root.querySelectorAll(selector));
    if (root.matches && root.matches(selector)) found.unshift(root);
    return found;
  }

  htmx.onLoad((root) => {
    within(root, "[data-answer-stream]").forEach(followAnswer);
    within(root, "[data-dropzone]").forEach(dropzone);
    within(root, "#document-list[data-summary]").forEach(documentSummary);
  });
})();

// The new client key's page (admin): a click selects the whole key for copying. A static
// file rather than an inline handler, so the page runs under the content security policy.
document.addEventListener("DOMContentLoaded", () => {
  const field = document.getElementById("new-client-key");
  if (field) {
    field.style.fontFamily = "monospace";
    field.addEventListener("click", () => field.select());
  }
});

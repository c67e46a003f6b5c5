// Forms with data-confirm="..." ask first in an accessible <dialog>; Confirm submits.
const dialog = document.getElementById("confirm");
const text = document.getElementById("confirm-text");
let pending = null;

document.addEventListener("submit", (ev) => {
  const form = ev.target;
  if (!(form instanceof HTMLFormElement) || !form.dataset.confirm) return;
  if (form.dataset.confirmed === "1") return;
  ev.preventDefault();
  pending = form;
  text.textContent = form.dataset.confirm;
  dialog.showModal();
  document.getElementById("confirm-ok").focus();
});

dialog.addEventListener("close", () => {
  const form = pending;
  pending = null;
  if (form && dialog.returnValue === "ok") {
    form.dataset.confirmed = "1";
    form.requestSubmit();
  }
});

// Inputs with data-select-on-focus select their whole value on focus (the new token's key).
// Here, not in an onfocus attribute: the Content-Security-Policy runs no inline handlers.
document.addEventListener("focusin", (ev) => {
  const el = ev.target;
  if (el instanceof HTMLInputElement && el.hasAttribute("data-select-on-focus")) el.select();
});

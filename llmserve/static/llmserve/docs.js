// Swagger UI over our OpenAPI document; "Authorize" takes an API key (bearer).
window.ui = SwaggerUIBundle({
  url: JSON.parse(document.getElementById("llmserve-schema-url").textContent),
  dom_id: "#swagger-ui",
  deepLinking: true,
  persistAuthorization: true,
});

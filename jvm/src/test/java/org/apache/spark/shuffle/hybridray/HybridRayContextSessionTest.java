package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

/**
 * The session token never travels in Spark's configuration (PySpark puts every Spark config
 * on spark-submit's command line): the driver reads it from the file the config names, the
 * executors take it from the shuffle handles, and both send it with their requests.
 */
class HybridRayContextSessionTest {
  private static final String TOKEN = "s0123456789abcdef0123456789abcdef";
  private final ObjectMapper json = new ObjectMapper();

  private JsonNode config(Path file) throws Exception {
    return json.readTree("{\"namespace\": \"ns\", \"session_file\": \"" + file + "\"}");
  }

  @Test
  void theDriverReadsTheTokenFromTheSessionFileOnceAndSendsIt(@TempDir Path dir)
      throws Exception {
    Path file = dir.resolve("token");
    Files.write(file, (TOKEN + "\n").getBytes(StandardCharsets.UTF_8));
    HybridRayContext.withSession(config(file), true);  // the manager's constructor
    Files.delete(file);  // spark_bridge removes it once Spark has started
    JsonNode sent = HybridRayContext.withSession(config(file), true);  // the context, later
    assertEquals(TOKEN, HybridRayContext.sessionToken(sent));
    assertNull(sent.get("session_file"));
    assertEquals("ns", sent.get("namespace").asText());
    // The same shuffle ids as spark_bridge derives from the token (app_prefix).
    assertEquals("acbe04b0", HybridRayContext.sessionTag(sent));
  }

  @Test
  void aSessionFileTheDriverCannotReadFailsTheStart(@TempDir Path dir) throws Exception {
    JsonNode missing = config(dir.resolve("gone"));
    assertThrows(IllegalStateException.class, () -> HybridRayContext.withSession(missing, true));
    Path bad = dir.resolve("bad");
    Files.write(bad, "not a token\n".getBytes(StandardCharsets.UTF_8));
    JsonNode notAToken = config(bad);
    assertThrows(IllegalStateException.class,
        () -> HybridRayContext.withSession(notAToken, true));
  }

  @Test
  void executorsTakeTheTokenFromTheHandlesNotFromAFile(@TempDir Path dir) throws Exception {
    JsonNode sent = HybridRayContext.withSession(config(dir.resolve("gone")), false);
    assertEquals("", HybridRayContext.sessionToken(sent));
    assertNull(sent.get("session_file"));
    JsonNode adopted = HybridRayContext.withToken(sent, TOKEN);
    assertEquals(TOKEN, HybridRayContext.sessionToken(adopted));
    assertEquals("ns", adopted.get("namespace").asText());
    assertFalse(sent.has("session_token"));  // a copy
  }

  @Test
  void withoutASessionThereIsNoToken() throws Exception {
    JsonNode sent = HybridRayContext.withSession(json.readTree("{\"namespace\": \"ns\"}"), true);
    assertEquals("", HybridRayContext.sessionToken(sent));
    assertEquals(json.readTree("{\"namespace\": \"ns\"}"), sent);
    assertEquals(8, HybridRayContext.sessionTag(sent).length());
  }
}
